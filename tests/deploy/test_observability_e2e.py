"""The CI proof of deploy/ and of tracing, on one running `glmserve serve` (fixed metrics ports) with
traces exported to a real OTLP/gRPC receiver in the test and a real Prometheus (Debian package)
scraping every service:

- one request's spans, sent by three processes (router, decode, prefill), share one trace id and
  nest client -> server across each gRPC hop (the context travels in the calls' metadata);
- under scripted load - streamed and plain requests, streams the client abandons, bad requests, the
  head of a two-stage LayerSplit prefill replica killed with SIGKILL while it computes, then the
  kvstore killed while requests run (the launcher restarts both) - every PromQL expression of every
  dashboard panel returns data over the run (a range query, as Grafana draws it), every panel shows a non-zero value except those named in `NOT_EXERCISED`
  (with why), and every recording and alert rule evaluates without error, over Prometheus' HTTP API.

The values each panel's queries returned are printed (run with ``-s`` to see them) and written to
``observability-panels.json`` in the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import grpc
import pytest
from deploy_tools import dashboard_queries, tool, undocumented
from otlp_receiver import OTLPReceiver, ReceivedSpan
from prometheus_server import PrometheusServer, Result, write_config
from scripted_load import Tally, client_for, long_requests, mixed_load, until_served

from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as prefill_pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2_grpc as prefill_grpc
from tests.serve_platform import ServePlatform, free_port_run
from tests.shared import HAS_MODEL, MODEL_DIR

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAS_MODEL, reason=f"no model at {MODEL_DIR}")]

MODEL = MODEL_DIR.name
VICTIM = "prefill-0"
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval at a 1 s step and a 1 s scrape interval: 4 scrapes

# Panels whose every value stays 0 (or NaN) in this run, and why: the event they show does not happen here.
NOT_EXERCISED: dict[tuple[str, str], str] = {
    ("glmserve-cache", "Device evictions"): "the run's prompts fit the workers' device KV pools (720 blocks each)",
    ("glmserve-workers", "Preemptions"): "the decode pool never runs out of blocks",
    ("glmserve-faults", "Host-tier failures, by op"): "only a host-tier write in flight when the kvstore is killed "
                                                      "fails (while it is away, writes are skipped, not failed)",
    ("glmserve-faults", "kvstore RPC errors"): "every kvstore call is valid (a killed kvstore counts nothing)",
    ("glmserve-transfer", "Stale stamps ignored"): "a stale stamp is a bug (asserted 0)",
    ("glmserve-workers", "Router admission queue"): "no request waits: `glmserve serve` runs the router with "
                                                    "its default 64 running slots",
    ("glmserve-workers", "Router queue wait p99"): "no request waits (NaN: a quantile of no observations)",
}
# Of those, the ones that must stay 0: any value is a bug.
MUST_STAY_ZERO = [("glmserve-transfer", "Stale stamps ignored")]


def _prefill_running(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        try:
            return prefill_grpc.PrefillStub(channel).Health(prefill_pb.HealthRequest(), timeout=2).running
        except grpc.RpcError:
            return 0


def _kill_while_computing(platform: ServePlatform, tally: Tally) -> None:
    """Long prompts go to the prefill worker; it is killed (SIGKILL) once it runs one of them."""
    load = threading.Thread(target=lambda: asyncio.run(long_requests(platform.url, MODEL, 2, 1500, tally)))
    load.start()
    deadline = time.monotonic() + 60
    while _prefill_running(platform.addresses[VICTIM]) == 0:
        assert time.monotonic() < deadline, "the prefill worker never ran a long prompt"
        time.sleep(0.02)
    platform.kill(VICTIM)
    load.join(180)
    assert not load.is_alive()


def _run_load(platform: ServePlatform, prometheus: PrometheusServer) -> Tally:
    tally = Tally()
    asyncio.run(mixed_load(platform.url, MODEL, 2, tally, seed=1))
    _kill_while_computing(platform, tally)
    asyncio.run(mixed_load(platform.url, MODEL, 1, tally, seed=2))  # while the worker restarts
    platform.expect(rf"glmserve: {VICTIM} is back at", timeout_s=300)  # restarted and ready
    asyncio.run(until_served(platform.url, MODEL, tally, timeout_s=60))  # and the router reaches it again
    # Prometheus must see the restarted worker's counters at 0 first: a series whose first sample
    # already counts the load-backs below shows no increase (the load-back panel stayed at 0 in CI).
    prometheus.wait_scrapes(2)
    asyncio.run(mixed_load(platform.url, MODEL, 2, tally, seed=3))  # its device cache is empty now
    platform.kill("kvstore")  # not on the data path: the workers' publishes and host-tier writes fail
    asyncio.run(mixed_load(platform.url, MODEL, 2, tally, seed=4))
    platform.expect(r"glmserve: kvstore is back at", timeout_s=120)
    asyncio.run(mixed_load(platform.url, MODEL, 1, tally, seed=5))
    return tally


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """(platform, prometheus scraping it, the OTLP receiver its spans go to); stopped at the end."""
    tmp = tmp_path_factory.mktemp("observed")
    prometheus_binary = tool("prometheus")
    receiver = OTLPReceiver()
    tracing_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200",
                   "OTEL_SERVICE_NAME": "", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    platform = ServePlatform(tmp / "serve.log", "--host-tier-bytes", str(128 << 20), "--drain-timeout", "2",
                             stages=2, env={"OMP_NUM_THREADS": "1", **tracing_env})
    config = write_config(tmp / "prometheus.yml", platform.metrics_targets())
    prometheus = PrometheusServer(prometheus_binary, config, tmp / "tsdb", free_port_run(1), tmp / "prom.log")
    try:
        prometheus.wait_ready()
        platform.wait_serving()
        yield platform, prometheus, receiver
    finally:
        prometheus.stop()
        platform.stop()
        receiver.stop()


async def _one_stream(url: str) -> str:
    async with client_for(url) as client:
        request_id = ""
        async for chunk in await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "trace me"}], max_tokens=8, stream=True):
            request_id = chunk.id
        return request_id


def _one_trace(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    roots = [s for s in spans if s.attributes.get("glmserve.request_id") == request_id and s.kind == "INTERNAL"]
    return [s for s in spans if roots and s.trace_id == roots[0].trace_id]


def _child(spans: list[ReceivedSpan], parent: ReceivedSpan, service: str, name: str, kind: str) -> ReceivedSpan:
    (child,) = [s for s in spans if s.parent_id == parent.span_id and s.service == service
                and s.name.endswith(name) and s.kind == kind]
    return child


def test_one_request_is_one_trace_across_router_decode_and_prefill(observed) -> None:
    platform, _, receiver = observed
    request_id = asyncio.run(_one_stream(platform.url))
    services = {"glmserve-router", "glmserve-decode", "glmserve-prefill"}
    spans = receiver.wait_for(lambda got: len(_one_trace(got, request_id)) >= 4
                              and {s.service for s in _one_trace(got, request_id)} == services)
    trace = _one_trace(spans, request_id)
    (root,) = [s for s in trace if s.name == "glmserve.request"]
    assert root.service == "glmserve-router" and root.parent_id == "" and not root.error
    assert root.attributes["glmserve.finish_reason"] in ("stop", "length")
    generate = _child(trace, root, "glmserve-decode", "Decode/Generate", "SERVER")
    prefill_call = _child(trace, generate, "glmserve-decode", "Prefill/Prefill", "CLIENT")
    assert prefill_call.attributes["glmserve.request_id"] == request_id
    prefill = _child(trace, prefill_call, "glmserve-prefill", "Prefill/Prefill", "SERVER")
    assert not any(s.error for s in (generate, prefill_call, prefill))
    assert not any("Health" in s.name for s in spans), "health polls are not traced"


def _panels(prometheus: PrometheusServer, start: float, end: float) -> dict[tuple[str, str], list[tuple[str, Result]]]:
    """(dashboard uid, panel title) -> each target's PromQL and its range-query result over the run,
    with the variables Grafana would send for that range at a 1 s step."""
    panels: dict[tuple[str, str], list[tuple[str, Result]]] = {}
    for uid, title, expr in dashboard_queries({"$__rate_interval": RATE_INTERVAL}):
        panels.setdefault((uid, title), []).append((expr, prometheus.query_range(expr, start, end)))
    return panels


def _write_report(path, tally: Tally, panels) -> None:
    rows = [{"dashboard": uid, "panel": title, "expr": expr, "value": result.summary()}
            for (uid, title), targets in panels.items() for expr, result in targets]
    path.write_text(json.dumps({"load": dict(tally.outcomes), "errors": tally.errors, "panels": rows}, indent=1))
    print(f"\nload outcomes: {dict(tally.outcomes)}")
    print("errors:", *tally.errors, sep="\n  ")
    for row in rows:
        print(f"{row['dashboard']:<24} {row['panel']:<44} {row['value']}")


def test_every_dashboard_query_and_rule_evaluates_on_live_data(observed, tmp_path) -> None:
    platform, prometheus, _ = observed
    start = time.time()
    tally = _run_load(platform, prometheus)
    prometheus.wait_scrapes(3)
    end = time.time()
    assert all(prometheus.targets_up().values()), prometheus.targets_up()

    panels = _panels(prometheus, start, end)
    _write_report(tmp_path / "observability-panels.json", tally, panels)
    # a query of a not-exercised panel may have only NaN (a quantile of nothing), never no series
    no_data = [(key, expr) for key, targets in panels.items() for expr, r in targets
               if not (r.series if key in NOT_EXERCISED else r.finite)]
    assert not no_data, f"queries without data: {no_data}"
    flat = {key for key, targets in panels.items() if not any(r.nonzero for _, r in targets)}
    assert flat <= set(NOT_EXERCISED), f"panels that stayed at 0: {sorted(flat - set(NOT_EXERCISED))}"
    print(f"listed as not exercised but non-zero this run: {sorted(set(NOT_EXERCISED) - flat)}")
    for key in MUST_STAY_ZERO:
        assert key in flat, f"{key}: {panels[key]}"

    exported = {n for n in prometheus.metric_names() if n.startswith("glmserve_")}
    assert len(exported) > 50 and not undocumented(exported), f"not in docs/metrics.md: {undocumented(exported)}"

    rules = prometheus.rules()
    broken = [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok" or r.get("lastError")]
    assert rules and not broken, broken
    alerts = {r["name"]: r["state"] for r in rules if r["type"] == "alerting"}
    print("alerts:", alerts)
    assert alerts["GlmserveHighErrorRatio"] in ("pending", "firing"), alerts  # the kill's 5xx
    assert alerts["GlmserveKVTransferStaleStamp"] == "inactive", alerts
    for rule in rules:
        result = prometheus.query(rule["query"], end)  # fails on an evaluation error
        if rule["type"] == "recording":
            assert result.series, f"recording rule {rule['name']} has no data: {rule['query']}"

    window = f"{math.ceil(end - start) + 10}s"

    def total(expr: str) -> float:
        return sum(prometheus.query(expr.replace("WINDOW", window), end).finite)

    assert total('sum(increase(glmserve_router_requests_total{status="499"}[WINDOW]))') > 0
    assert total('sum(increase(glmserve_router_requests_total{status="400"}[WINDOW]))') > 0
    assert total("sum(increase(glmserve_aborts_total[WINDOW]))") > 0
    # the killed worker: one new process, counted by the launcher too (GLMSERVE_RESTARTS)
    assert total('sum(changes(process_start_time_seconds{job="glmserve-prefill"}[WINDOW]))') >= 1
    assert total('sum(increase(glmserve_process_restarts_total{job="glmserve-prefill"}[WINDOW]))') >= 1
    assert total('sum(increase(glmserve_process_restarts_total{job="glmserve-kvstore"}[WINDOW]))') >= 1
    assert total('sum(increase(glmserve_process_restarts_total{job=~"glmserve-(router|decode)"}[WINDOW]))') == 0
    assert total("sum(increase(glmserve_layersplit_kv_transfer_seconds_count[WINDOW]))") > 0
    failed = ('sum(increase(glmserve_router_requests_total{status=~"5.."}[WINDOW]))'
              " + sum(increase(glmserve_router_rejections_total[WINDOW]))")
    assert total(failed) > 0, "the killed worker's requests left no failure in the metrics"
    assert any(kind.startswith("error:") for kind in tally.outcomes), tally.outcomes
