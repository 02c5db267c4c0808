"""The helm chart (helm/glmserve), tested over `helm template` output (the helm-unittest plugin is not
installable here): lint and Kubernetes schema validation for every values file it ships, then what
the chart promises - workers addressed through headless-Service DNS, args the services really parse,
grace periods that cover the drain, LayerSplit stage pairing, GPU resources, monitoring objects."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from deploy_tools import CHART, DASHBOARDS, REPO, RULES, run, tool
from helm_render import (
    CRD_KINDS,
    VALUES_FILES,
    by_kind,
    helm,
    pod_templates,
    render,
    render_text,
    values_args,
)

from glmserve.services.decode.main import DecodeConfig
from glmserve.services.kvstore.main import KVStoreConfig
from glmserve.services.prefill.main import PrefillConfig
from glmserve.services.router.main import RouterConfig
from glmserve.services.tracing import TracingConfig

KUBERNETES_VERSION = "1.35.0"  # the helm binary's client version (helm v4.1, KubeClientVersion v1.35)
CRD_SCHEMAS = Path(__file__).resolve().parent / "crd_schemas"
MODULE_CONFIGS = {"glmserve.services.router.main": RouterConfig, "glmserve.services.prefill.main": PrefillConfig,
                  "glmserve.services.decode.main": DecodeConfig, "glmserve.services.kvstore.main": KVStoreConfig}


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_lint_strict(values_file: str) -> None:
    code, out, err = helm("lint", "--strict", ".", *values_args(values_file))
    assert code == 0, out + err


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_core_kinds_validate_strictly(values_file: str) -> None:
    result = run(tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, "-", stdin=render_text(values_file))
    assert result.returncode == 0, result.stdout + result.stderr
    unknown = set(re.findall(r"Couldn't find schema for kind (\w+)", result.stdout + result.stderr))
    assert unknown <= CRD_KINDS, f"kinds validated by nothing: {unknown - CRD_KINDS}"
    assert "ERROR" not in result.stdout + result.stderr


def _strict_schema(node: object) -> object:
    """Reject unknown fields, as `kubectl apply --validate=strict` does for a structural CRD schema;
    Go's regex syntax where Python's differs."""
    if isinstance(node, dict):
        node = {k: _strict_schema(v) for k, v in node.items()}
        if isinstance(node.get("pattern"), str) and node["pattern"].startswith("^(?i)"):
            node["pattern"] = "(?i)^" + node["pattern"][5:]  # Go allows the flag after ^, Python not
        if "properties" in node and "additionalProperties" not in node and not node.get(
                "x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict_schema(v) for v in node]
    return node


@pytest.mark.parametrize("values_file", ["ci/monitoring-values.yaml", "values-gpu-production.yaml"])
def test_crd_kinds_validate_against_their_crd_schemas(values_file: str) -> None:
    docs = [d for d in render(values_file) if d["kind"] in CRD_KINDS]
    assert {d["kind"] for d in docs} >= ({"ServiceMonitor", "PrometheusRule"})
    for doc in docs:
        schema = json.loads((CRD_SCHEMAS / f"monitoring.coreos.com_v1_{doc['kind'].lower()}.json").read_text())
        jsonschema.Draft7Validator(_strict_schema(schema)).validate(doc)
    assert {d["kind"] for d in render("ci/monitoring-values.yaml") if d["kind"] in CRD_KINDS} == CRD_KINDS


def test_monitoring_crds_are_off_by_default() -> None:
    assert not [d for d in render() if d["kind"] in CRD_KINDS]


@pytest.mark.parametrize("bad", ["transfer=ucx", "redis.enabled=false", "prefill.layerSplit=0-2;3-7",
                                 "slo.ttft.objective=1.5", "router.port=0", "model.servedName=", "mtp=sometimes"])
def test_schema_rejects_bad_values(bad: str) -> None:
    code, _, err = helm("template", "glm", ".", "--set", bad)
    assert code != 0 and ("schema" in err or "required" in err), err


def _env(docs: list[dict], container: dict) -> dict[str, str]:
    """What Kubernetes expands $(NAME) with: the shared ConfigMap and the container's own env."""
    (source,) = container["envFrom"]
    env = dict(by_kind(docs, "ConfigMap")[source["configMapRef"]["name"]]["data"])
    example = {"POD_IP": "10.1.2.3", "POD_NAME": "pod-0", "POD_INDEX": "0", "GLMSERVE_API_KEY": "k"}
    env.update({e["name"]: e.get("value", example.get(e["name"])) for e in container["env"]})
    env["GLMSERVE_MODEL_PATH"] = str(REPO / "models" / "glm52-tiny")  # the container path is not here
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


@pytest.mark.parametrize("values_file", ["values.yaml", "values-cpu-demo.yaml", "ci/monitoring-values.yaml"])
def test_every_container_command_parses_with_the_services_own_flags(values_file: str) -> None:
    docs = render(values_file)
    checked = set()
    for name, spec in pod_templates(docs).items():
        for c in spec["containers"]:
            if c.get("command", [])[:2] != ["python", "-m"]:
                continue  # Redis
            module = c["command"][2]
            env = _env(docs, c)
            config = MODULE_CONFIGS[module].from_args([_expand(a, env) for a in c["args"]])
            assert config.host == "10.1.2.3", name  # every listener binds the pod's own address
            checked.add(module)
    assert checked == set(MODULE_CONFIGS)


@pytest.mark.parametrize("mtp", ["off", "2"])
def test_mtp_is_one_value_for_every_worker(mtp: str) -> None:
    """Prefill (every LayerSplit stage) and decode workers get the same --mtp: it sets their KV layout."""
    docs = render("values-gpu-production.yaml", "--set", f"mtp={mtp}")
    workers = [(name, c) for name, spec in pod_templates(docs).items() for c in spec["containers"]
               if c.get("command", [])[2:3] in (["glmserve.services.prefill.main"], ["glmserve.services.decode.main"])]
    assert len(workers) >= 3  # two prefill stages and the decode worker
    for name, c in workers:
        (flag,) = [_expand(a, _env(docs, c)) for a in c["args"] if a.startswith("--mtp=")]
        assert flag == f"--mtp={mtp}", name


def test_router_addresses_every_worker_pod_through_its_headless_service() -> None:
    docs = render("values-gpu-production.yaml")
    services = by_kind(docs, "Service")
    sets = by_kind(docs, "StatefulSet")
    (router,) = [c for c in pod_templates(docs)["glm-glmserve-router"]["containers"]]
    args = dict(a.split("=", 1) for a in router["args"])
    for flag, sts_name in (("--prefill", "glm-glmserve-prefill-s0"), ("--decode", "glm-glmserve-decode")):
        sts = sets[sts_name]
        assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
        expected = [f"{sts_name}-{i}.{sts_name}.serving.svc:{sts['spec']['template']['spec']['containers'][0]['ports'][0]['containerPort']}"
                    for i in range(sts["spec"]["replicas"])]
        assert args[flag].split(",") == expected


def test_layersplit_stages_are_paired_statefulsets() -> None:
    docs = render("values-gpu-production.yaml")
    stages = {n: s for n, s in by_kind(docs, "StatefulSet").items() if "-prefill-s" in n}
    assert sorted(stages) == [f"glm-glmserve-prefill-s{i}" for i in range(4)]
    for i, (_name, sts) in enumerate(sorted(stages.items())):
        assert sts["spec"]["replicas"] == 2 and sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["selector"]["matchLabels"]["glmserve.io/stage"] == str(i)
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert f"--stage-index={i}" in args and "--layer-split=0-18,19-38,39-58,59-77" in args
        # Pod r of every stage is replica r: each knows every stage's pod r, and the replica's id.
        addresses = [f"glm-glmserve-prefill-s{j}-$(POD_INDEX).glm-glmserve-prefill-s{j}.serving.svc:50061"
                     for j in range(4)]
        assert f"--stage-addresses={','.join(addresses)}" in args
        assert [a for a in args if a.startswith("--worker-id=")] == ["--worker-id=glm-glmserve-prefill-s0-$(POD_INDEX)"]
        gpus = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == 8


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_grace_period_covers_prestop_and_drain(values_file: str) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if values_file != "values.yaml":
        values["drain"].update(yaml.safe_load((CHART / values_file).read_text()).get("drain", {}))
    sleep, drain = values["drain"]["preStopSleepSeconds"], values["drain"]["timeoutSeconds"]
    for name, spec in pod_templates(render(values_file)).items():
        if name.endswith("-redis"):
            continue
        assert spec["terminationGracePeriodSeconds"] == sleep + drain + 5, name
        (container,) = spec["containers"]
        assert container["lifecycle"]["preStop"]["sleep"]["seconds"] == sleep, name
        assert "readinessProbe" in container and "livenessProbe" in container, name


def test_pdbs_select_their_workloads_and_hpa_replaces_replicas() -> None:
    docs = render("ci/monitoring-values.yaml")
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")}
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert [n for n, labels in pods.items() if selector.items() <= labels.items()], pdb["metadata"]["name"]
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"]["name"] == "glm-glmserve-router"
    assert "replicas" not in by_kind(docs, "Deployment")["glm-glmserve-router"]["spec"]
    assert not by_kind(render(), "HorizontalPodAutoscaler")


def test_redis_bundled_or_external() -> None:
    bundled = render()
    assert "glm-glmserve-redis" in by_kind(bundled, "Deployment")
    assert by_kind(bundled, "ConfigMap")["glm-glmserve"]["data"]["GLMSERVE_REDIS_URL"] == "redis://glm-glmserve-redis:6379/0"
    external = render("ci/monitoring-values.yaml")
    assert "glm-glmserve-redis" not in by_kind(external, "Deployment")
    assert by_kind(external, "ConfigMap")["glm-glmserve"]["data"]["GLMSERVE_REDIS_URL"] == "redis://redis.example.svc:6379/0"


def test_dashboards_configmap_ships_the_repository_dashboards() -> None:
    data = by_kind(render(), "ConfigMap")["glm-glmserve-dashboards"]["data"]
    assert data == {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}


def test_prometheus_rule_has_the_repository_rules_and_slo_targets_from_values() -> None:
    (rule,) = by_kind(render("ci/monitoring-values.yaml"), "PrometheusRule").values()
    groups = rule["spec"]["groups"]
    repo_groups = yaml.safe_load((RULES / "glmserve.rules.yml").read_text())["groups"]
    assert groups[1:] == repo_groups
    defaults = yaml.safe_load((RULES / "slo-targets.yml").read_text())["groups"]
    for ours, theirs in zip(groups[:1], defaults, strict=True):
        assert ours["name"] == theirs["name"]
        assert [(r["expr"].replace(" ", ""), r["labels"]) for r in ours["rules"]] == [
            (r["expr"].replace(" ", ""), r["labels"]) for r in theirs["rules"]]
    (prod,) = by_kind(render("values-gpu-production.yaml"), "PrometheusRule").values()
    assert prod["spec"]["groups"][0]["rules"][0]["labels"] == {"slo": "ttft", "le": "10.0"}


def test_rendered_prometheus_rule_passes_promtool(tmp_path) -> None:
    (rule,) = by_kind(render("ci/monitoring-values.yaml"), "PrometheusRule").values()
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = run(tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def _plain_env(container: dict, configmaps: dict[str, dict]) -> dict[str, str]:
    """The container's environment as the process sees it (ConfigMap refs and literal values)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]].get("data", {}))
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def test_tracing_values_turn_on_each_services_tracing_under_its_own_name() -> None:
    for extra, on in ((), False), (("--set", "tracing.otlpEndpoint=http://otel-collector:4317"), True):
        docs = render("values.yaml", *extra)
        configmaps, roles = by_kind(docs, "ConfigMap"), set()
        for name, pod in pod_templates(docs).items():
            for container in pod["containers"]:
                env = _plain_env(container, configmaps)
                if "OTEL_SERVICE_NAME" not in env:
                    continue
                role = env["OTEL_SERVICE_NAME"].removeprefix("glmserve-")
                config = TracingConfig.from_env(role, env)
                assert config.enabled is on, name
                assert not on or config.service_name == f"glmserve-{role}", name
                roles.add(role)
        assert roles == {"router", "prefill", "decode", "kvstore"}
