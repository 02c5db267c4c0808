"""The metrics endpoint every worker and the kvstore serve: GET and HEAD /metrics (HEAD: 200 and headers
only, as scrapers that probe with HEAD need), 404 elsewhere, the service labels on every sample, the
process and build-info series; and the fixed metrics ports of `glmserve serve`."""

from __future__ import annotations

import http.client
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from glmserve.commands.serve import ServeConfig
from glmserve.services.metrics_exposition import RESTARTS_ENV, MetricsServer, add_process_metrics, labelled

MODEL = Path(__file__).resolve().parents[2] / "models" / "glm52-tiny"


@pytest.fixture
def server():
    registry = CollectorRegistry()
    Counter("glmserve_things", "Things.", ["kind"], registry=registry).labels(kind="a").inc(3)
    add_process_metrics(registry, "decode")
    srv = MetricsServer(labelled(registry, {"model_name": "m", "role": "decode"}), "127.0.0.1", 0)
    yield srv
    srv.close()


def _request(port: int, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(method, path)
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


def test_get_serves_every_sample_with_the_service_labels(server: MetricsServer) -> None:
    status, headers, body = _request(server.port, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]
    assert samples and all(s.labels["model_name"] == "m" and s.labels["role"] == "decode" for s in samples)
    by_name = {s.name: s for s in samples}
    assert by_name["glmserve_things_total"].value == 3 and by_name["glmserve_things_total"].labels["kind"] == "a"
    assert by_name["glmserve_build_info"].value == 1 and "process_start_time_seconds" in by_name


def test_head_is_a_200_with_headers_and_no_body(server: MetricsServer) -> None:
    status, headers, body = _request(server.port, "HEAD", "/metrics")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_other_paths_are_404(server: MetricsServer) -> None:
    assert _request(server.port, "GET", "/nothing")[0] == 404
    assert _request(server.port, "HEAD", "/")[0] == 404


def test_serve_fixes_each_childs_metrics_port_from_the_base() -> None:
    cfg = ServeConfig(MODEL, prefill_workers=2, decode_workers=3, metrics_port_base=9100)
    assert [cfg.metrics_port(i) for i in range(6)] == [9100, 9101, 9102, 9103, 9104, 9105]
    assert ServeConfig(MODEL).metrics_port(0) is None  # default: free ports
    with pytest.raises(ValueError, match="metrics_port_base"):
        ServeConfig(MODEL, metrics_port_base=65534, prefill_workers=2)


def test_restarts_carry_the_supervisors_count(monkeypatch: pytest.MonkeyPatch) -> None:
    def restarts() -> float:
        registry = CollectorRegistry()
        add_process_metrics(registry, "prefill")
        return registry.get_sample_value("glmserve_process_restarts_total")

    monkeypatch.delenv(RESTARTS_ENV, raising=False)
    assert restarts() == 0
    monkeypatch.setenv(RESTARTS_ENV, "3")
    assert restarts() == 3
    monkeypatch.setenv(RESTARTS_ENV, "three")
    with pytest.raises(ValueError, match=RESTARTS_ENV):
        restarts()
