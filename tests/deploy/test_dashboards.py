"""The Grafana dashboards: the committed JSON is what deploy/grafana/dashboards.py writes, each one has
the panels the issue asks for, every query parses as PromQL (promtool), and every metric a query reads
is documented in docs/metrics.md. (The CI run in test_observability_e2e.py evaluates them on live data.)"""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import yaml
from deploy_tools import DASHBOARDS, DEPLOY, dashboard_queries, run, tool, undocumented


def _generator():
    spec = importlib.util.spec_from_file_location("dashboards", DEPLOY / "grafana" / "dashboards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_committed_dashboards_are_generated() -> None:
    rendered = _generator().render()
    committed = {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}
    assert committed == rendered, "run: python deploy/grafana/dashboards.py"


def test_the_six_dashboards_with_unique_uids_and_a_model_variable() -> None:
    boards = [json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))]
    assert {b["uid"] for b in boards} == {"glmserve-slo", "glmserve-transfer", "glmserve-cache",
                                          "glmserve-spec-decoding", "glmserve-faults", "glmserve-workers"}
    for board in boards:
        variables = {v["name"] for v in board["templating"]["list"]}
        assert {"datasource", "model_name"} <= variables
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and all(p["targets"] for p in board["panels"])


def test_every_query_parses(tmp_path) -> None:
    queries = dashboard_queries()
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, _, expr) in enumerate(queries)]}]}
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run(tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_read_is_documented() -> None:
    names = set()
    for _, _, expr in dashboard_queries():
        names |= {n for n in re.findall(r"\b(glmserve_[a-z0-9_]+)", expr)}
    assert names and not undocumented(names), f"not in docs/metrics.md: {undocumented(names)}"
