"""A real Prometheus (the Debian package) for tests: started on 127.0.0.1 with a generated config
that scrapes the given targets every second and loads the repository's rule files; queried over its
HTTP API (instant queries, rule health)."""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from deploy_tools import RULES

SCRAPE_INTERVAL_S = 1


@dataclass(frozen=True)
class Result:
    """A query's answer: each series' labels and its values (one for an instant query, one per step
    of a range query, as a Grafana panel draws them)."""

    series: tuple[tuple[dict[str, str], tuple[float, ...]], ...]

    @property
    def finite(self) -> list[float]:
        return [v for _, values in self.series for v in values if math.isfinite(v)]

    @property
    def nonzero(self) -> bool:
        return any(v != 0 for v in self.finite)

    def summary(self) -> str:
        """Each series' legend with its largest and its last value (what a panel shows, in words)."""
        if not self.finite:
            return "no data"
        return ", ".join(f"{_legend(labels)}={_shown(values)}" for labels, values in self.series)


def _shown(values: tuple[float, ...]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "nan"
    return f"{finite[-1]:.4g}" if len(values) == 1 else f"max {max(finite):.4g} last {finite[-1]:.4g}"


def _legend(labels: dict[str, str]) -> str:
    shown = {k: v for k, v in labels.items() if k not in ("model_name", "__name__")}
    return "{" + ",".join(f"{k}={v}" for k, v in sorted(shown.items())) + "}" if shown else "{}"


def write_config(path: Path, jobs: dict[str, list[str]]) -> Path:
    """A Prometheus config scraping each job's ``host:port`` targets, with deploy/prometheus/rules."""
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
                   "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
        "rule_files": [str(p) for p in sorted(RULES.glob("*.yml"))],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                           for job, targets in jobs.items()],
    }
    path.write_text(yaml.safe_dump(config))
    return path


class PrometheusServer:
    """``prometheus`` running with ``config`` on ``127.0.0.1:port``, its data under ``data``."""

    def __init__(self, binary: str, config: Path, data: Path, port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        self._http = httpx.Client(base_url=self.url, timeout=30)

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"prometheus exited with {self.proc.returncode}"
            try:
                if self._http.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus did not get ready"
            time.sleep(0.2)

    def _api(self, path: str, **params: str) -> dict | list:
        reply = self._http.get(f"/api/v1/{path}", params=params)
        body = reply.json()
        assert reply.status_code == 200 and body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> Result:
        """An instant query (at the Unix time ``at``, default now); fails on a PromQL error."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self._api("query", **params)
        if data["resultType"] == "scalar":
            return Result((({}, (float(data["result"][1]),)),))
        return Result(tuple((s["metric"], (float(s["value"][1]),)) for s in data["result"]))

    def query_range(self, expr: str, start: float, end: float, step_s: float = SCRAPE_INTERVAL_S) -> Result:
        """A range query from ``start`` to ``end`` (Unix times); fails on a PromQL error."""
        data = self._api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s}s")
        return Result(tuple((s["metric"], tuple(float(v) for _, v in s["values"])) for s in data["result"]))

    def targets_up(self) -> dict[str, bool]:
        """``job/instance`` -> whether its last scrape succeeded."""
        active = self._api("targets")["activeTargets"]
        return {f"{t['labels']['job']}/{t['labels']['instance']}": t["health"] == "up" for t in active}

    def metric_names(self) -> set[str]:
        """Every metric name Prometheus holds (scraped or recorded)."""
        return set(self._api("label/__name__/values"))

    def rules(self) -> list[dict]:
        """Every loaded rule with its ``health``, ``lastError`` and ``query``."""
        return [rule for group in self._api("rules")["groups"] for rule in group["rules"]]

    def wait_scrapes(self, count: int = 2) -> None:
        """Until every target was scraped ``count`` more times and the rules evaluated after."""
        time.sleep((count + 1) * SCRAPE_INTERVAL_S)

    def stop(self) -> None:
        self._http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
