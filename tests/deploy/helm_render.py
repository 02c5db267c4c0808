"""Rendering the chart: `helm template` (and `helm lint --strict`) for a values file, the output parsed
with a YAML loader that rejects duplicate keys (which the API server would silently collapse)."""

from __future__ import annotations

import yaml
from deploy_tools import CHART, run, tool

VALUES_FILES = ["values.yaml", "values-cpu-demo.yaml", "values-gpu-production.yaml", "ci/monitoring-values.yaml"]
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


class _StrictLoader(yaml.SafeLoader):
    pass


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    keys = [loader.construct_object(key, deep=deep) for key, _ in node.value]
    duplicates = sorted({str(k) for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"duplicate keys {duplicates} at {node.start_mark}")
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def values_args(values_file: str) -> list[str]:
    return [] if values_file == "values.yaml" else ["-f", str(CHART / values_file)]


def helm(*args: str) -> tuple[int, str, str]:
    result = run(tool("helm"), *args, cwd=CHART)
    return result.returncode, result.stdout, result.stderr


def render_text(values_file: str = "values.yaml", *extra: str) -> str:
    code, out, err = helm("template", "glm", ".", "--namespace", "serving", *values_args(values_file), *extra)
    assert code == 0, err
    return out


def render(values_file: str = "values.yaml", *extra: str) -> list[dict]:
    return [doc for doc in yaml.load_all(render_text(values_file, *extra), Loader=_StrictLoader) if doc]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """Workload name -> its pod spec, for Deployments and StatefulSets."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet")}
