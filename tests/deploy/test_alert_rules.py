"""The Prometheus side of deploy/: the compose configuration and the rule files pass `promtool check`,
and every alert fires and stays silent where its unit tests (deploy/prometheus/tests) say."""

from __future__ import annotations

import yaml
from deploy_tools import DEPLOY, RULES, run, tool


def test_rule_files_are_valid() -> None:
    result = run(tool("promtool"), "check", "rules", *map(str, sorted(RULES.glob("*.yml"))))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass() -> None:
    tests = DEPLOY / "prometheus" / "tests"
    result = run(tool("promtool"), "test", "rules", "alerts.test.yml", cwd=tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    alerts = {rule["alert"] for group in yaml.safe_load((RULES / "glmserve.rules.yml").read_text())["groups"]
              for rule in group["rules"] if "alert" in rule}
    cases = yaml.safe_load((DEPLOY / "prometheus" / "tests" / "alerts.test.yml").read_text())["tests"]
    fired, silent = set(), set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else silent).add(check["alertname"])
    assert alerts and alerts == fired == silent


def test_compose_prometheus_config_is_valid_and_scrapes_every_service() -> None:
    config = DEPLOY / "prometheus" / "prometheus.yml"
    result = run(tool("promtool"), "check", "config", "--syntax-only", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = {job["job_name"] for job in yaml.safe_load(config.read_text())["scrape_configs"]}
    assert {f"glmserve-{role}" for role in ("router", "kvstore", "prefill", "decode")} <= jobs
