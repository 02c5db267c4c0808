"""docker-compose.yml and the Dockerfile, checked offline: Debian's `docker-compose config -q`
validates the file without an engine; the rendered config is then checked for what we promise
(one container per service, read-only model, loopback-only router port, healthchecks)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from router_fixtures import MODEL_DIR

from glmserve.commands.serve import module_exists
from glmserve.services.decode.main import DecodeConfig
from glmserve.services.prefill.main import PrefillConfig
from glmserve.services.router.main import RouterConfig

REPO = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose")
SERVICES = {"router", "prefill", "decode", "kvstore", "redis", "prometheus", "grafana"}
OBSERVABILITY = {"prometheus", "grafana"}

pytestmark = pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (apt-get install docker-compose)")


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}  # no GLMSERVE_* overrides from the caller
    return subprocess.run([COMPOSE, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def config() -> dict:
    rendered = _compose("config")
    assert rendered.returncode == 0, rendered.stderr
    return yaml.safe_load(rendered.stdout)


def test_config_is_valid() -> None:
    result = _compose("config", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


def test_one_container_per_service_each_with_a_healthcheck(config: dict) -> None:
    services = config["services"]
    assert set(services) == SERVICES
    for name, service in services.items():
        assert service["healthcheck"]["test"][0] == "CMD", name
        if name not in {"redis"} | OBSERVABILITY:
            assert service["image"] == "glmserve:latest" and "build" in service, name
            module = service["command"][service["command"].index("-m") + 1]
            assert module_exists(module), f"{name} runs {module}, which does not exist"


def test_model_is_mounted_read_only_and_only_router_and_dashboards_are_published_on_loopback(config: dict) -> None:
    services = config["services"]
    for name in ("router", "prefill", "decode"):
        (mount,) = services[name]["volumes"]
        assert mount["read_only"] is True and mount["target"] == "/model", name
    assert services["router"]["ports"] == ["127.0.0.1:8000:8000/tcp"]
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090/tcp"]
    assert services["grafana"]["ports"] == ["127.0.0.1:3000:3000/tcp"]
    assert all("ports" not in s for n, s in services.items() if n not in {"router"} | OBSERVABILITY)


def test_prometheus_and_grafana_are_provisioned_from_deploy(config: dict) -> None:
    mounts = {name: {m["target"]: Path(m["source"]).relative_to(REPO).as_posix() for m in config["services"][name]["volumes"]}
              for name in OBSERVABILITY}
    assert mounts["prometheus"] == {"/etc/prometheus/prometheus.yml": "deploy/prometheus/prometheus.yml",
                                    "/etc/prometheus/rules": "deploy/prometheus/rules"}
    assert mounts["grafana"] == {"/etc/grafana/provisioning": "deploy/grafana/provisioning",
                                 "/var/lib/grafana/dashboards": "deploy/grafana/dashboards"}
    targets = {t for job in yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"]
               for c in job["static_configs"] for t in c["targets"]}
    services = config["services"]
    for name in ("prefill", "decode", "kvstore"):  # each scraped on the metrics port its command fixes
        command = services[name]["command"]
        assert f"{name}:{command[command.index('--metrics-port') + 1]}" in targets, name
    assert "router:8000" in targets


def test_router_command_parses_with_the_router_flags(config: dict) -> None:
    command = config["services"]["router"]["command"]
    args = command[command.index("-m") + 2:]
    args[args.index("--model") + 1] = str(MODEL_DIR)  # the container path does not exist here
    router = RouterConfig.from_args(args)
    assert router.decode == ("decode:50062",) and router.prefill == ("prefill:50061",)
    assert router.kvstore == "kvstore:50070" and router.host == "0.0.0.0"


def test_worker_commands_parse_with_the_worker_flags_and_agree_on_mtp(config: dict) -> None:
    """Both workers take one GLMSERVE_MTP: it sets the KV layout they exchange."""
    parsed = []
    for name, worker in (("prefill", PrefillConfig), ("decode", DecodeConfig)):
        command = config["services"][name]["command"]
        assert command[command.index("--mtp") + 1] == "auto", name  # ${GLMSERVE_MTP:-auto}, unset here
        parsed.append(worker.from_args(command[command.index("-m") + 2:]))
    assert [c.mtp for c in parsed] == ["auto", "auto"]
    assert [c.transfer for c in parsed] == ["tcp", "tcp"]


def test_dockerfile_pins_cpu_torch_and_bakes_in_no_model() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert "download.pytorch.org/whl/cpu torch==2.13.0" in text
    copies = [line.split()[1] for line in text.splitlines() if line.startswith("COPY")]
    assert copies and not any(src in (".", "models") or src.startswith("models/") for src in copies)
