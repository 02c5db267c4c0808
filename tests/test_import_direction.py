"""Imports point one way (DESIGN "Layout"): core <- model <- kv <- engine <- services; core and text
import nothing heavier than themselves; the router never imports the engine, the model or torch
(not even inside a function), so it runs on a machine without torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "glmserve"

# package -> glmserve packages it must not import (at any depth, lazily or not)
FORBIDDEN = {
    "core": {"text", "model", "kv", "engine", "services", "commands", "proto_gen"},
    "text": {"model", "kv", "engine", "services", "commands"},
    "model": {"kv", "engine", "services", "commands"},
    "kv": {"engine", "services", "commands"},
    "engine": {"services", "commands"},
    "services/router": {"engine", "model"},
}
NO_TORCH = ("core", "text", "services/router")
SERVICES = ("router", "decode", "prefill", "kvstore")
# A service may use another's client (it talks to it through proto/), nothing else of it.
CLIENTS = ("glmserve.services.kvstore.client",)


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports, function-level and TYPE_CHECKING imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


def _violations(package: str, banned: set[str], torch: bool) -> list[str]:
    out = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] == "glmserve" and len(parts) > 1 and parts[1] in banned:
                out.append(f"{path.relative_to(ROOT)} imports {module}")
            if torch and parts[0] == "torch":
                out.append(f"{path.relative_to(ROOT)} imports torch")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    assert _violations(package, FORBIDDEN[package], package in NO_TORCH) == []


@pytest.mark.parametrize("service", SERVICES)
def test_services_do_not_import_each_other(service):
    others = [f"glmserve.services.{o}" for o in SERVICES if o != service]
    found = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((PACKAGE / "services" / service).rglob("*.py"))
        for module in _imports(path)
        if any(module == o or module.startswith(o + ".") for o in others) and module not in CLIENTS
    ]
    assert found == []


def test_only_the_kvstore_talks_to_redis():
    found = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted(PACKAGE.rglob("*.py")) if "proto_gen" not in path.parts
        for module in _imports(path)
        if module.split(".")[0] == "redis" and "kvstore" not in path.parts
    ]
    assert found == []


def test_the_checker_sees_lazy_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from glmserve.engine.engine import Engine\n    import torch\n")
    assert _imports(sample) == ["glmserve.engine.engine", "torch"]


def test_router_and_contract_load_without_torch():
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for package in NO_TORCH for p in (PACKAGE / package).rglob("*.py") if p.name != "__init__.py"
    )
    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
