"""Shared helpers of the deployment tests: the repository paths, the external tools they run
(promtool, helm), and the dashboards' queries with Grafana's variables filled in."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "rules"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
CHART = REPO / "helm" / "glmserve"

# What Grafana substitutes before it sends a query (the CI run and the parse check use the same).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}


def undocumented(names: set[str]) -> list[str]:
    """The metric names (as exposed: ``_total``, ``_bucket``, ... included) that docs/metrics.md does
    not mention; a histogram is documented by its base name, a counter with its ``_total``."""
    documented = (REPO / "docs" / "metrics.md").read_text()
    missing = []
    for name in names:
        base = re.sub(r"_(bucket|sum|count|created)$", "", name)
        if not any(f"`{n}`" in documented for n in (name, base, f"{base}_total")):
            missing.append(name)
    return sorted(missing)


def tool(name: str) -> str:
    """The path of an installed tool; skips (a CI failure, see conftest.py) when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (tools/install.sh installs it)")
    return path


def run(*argv: str, cwd: Path = REPO, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=timeout)


def dashboard_queries(variables: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, PromQL with the variables filled in) for every panel target;
    ``variables`` overrides some of `GRAFANA_VARIABLES`."""
    values = {**GRAFANA_VARIABLES, **(variables or {})}
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in values.items():
                    expr = expr.replace(var, value)
                queries.append((board["uid"], panel["title"], expr))
    return queries
