"""Tracing (glmserve/services/tracing.py): the OTEL_* variables that turn it on and configure it; off,
it costs nothing (no interceptors, no spans, the SDK never imported); on, a span's context
crosses a real gRPC call into the server's span and reaches a real OTLP receiver, Health calls
untraced. (Across the three processes of `glmserve serve`: test_observability_e2e.py.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest
from deploy_tools import REPO
from otlp_receiver import OTLPReceiver

from glmserve.proto_gen.glmserve.common.v1 import generation_pb2 as common_pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2_grpc as pb_grpc
from glmserve.services.tracing import Tracing, TracingConfig

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}


@pytest.mark.parametrize("env, service", [
    ({}, None),
    (ENDPOINT, "glmserve-decode"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4317"}, "glmserve-decode"),
    ({**ENDPOINT, "OTEL_SERVICE_NAME": "decode-3"}, "decode-3"),
    ({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}, None),
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}, None),
])
def test_on_only_with_an_otlp_endpoint_and_not_disabled(env: dict[str, str], service: str | None) -> None:
    assert TracingConfig.from_env("decode", env).service_name == service


@pytest.mark.parametrize("env, field", [
    ({**ENDPOINT, "OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
])
def test_an_exporter_we_do_not_ship_is_refused_by_name(env: dict[str, str], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TracingConfig.from_env("decode", env)


def test_off_costs_nothing() -> None:
    tracing = Tracing()
    assert tracing.server_interceptors() == [] and tracing.client_interceptors() == []
    span = tracing.start_request("r")
    assert span.metadata() == ()
    span.attempt(decode="d")
    span.end("error")
    # The SDK, the exporter and the gRPC instrumentation are not even imported by the services, with
    # no OTEL_* variables set (the API is: FastAPI imports it).
    code = ("import sys\n"
            "import glmserve.services.router.main, glmserve.services.decode.main, glmserve.services.prefill.main\n"
            "from glmserve.services.tracing import Tracing\n"
            "for role in ('router', 'decode', 'prefill'):\n"
            "    Tracing.from_env(role).start_request('r').end()\n"
            "parts = ('opentelemetry.sdk', 'opentelemetry.exporter', 'opentelemetry.instrumentation')\n"
            "assert not [m for m in sys.modules if m.startswith(parts)]\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


class _Prefill(pb_grpc.PrefillServicer):
    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillReply:
        return pb.PrefillReply(first_token=7)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        return pb.HealthReply(ready=True)


async def _call_through_traced_server(client: Tracing, server: Tracing) -> str:
    """A request span on ``client``; its context sent to a server traced by ``server``; returns
    the span's trace id."""
    srv = grpc.aio.server(interceptors=server.server_interceptors())
    pb_grpc.add_PrefillServicer_to_server(_Prefill(), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        span = client.start_request("req-1", prompt_tokens=3)
        metadata = span.metadata()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PrefillStub(channel)
            request = pb.PrefillRequest(transfer=common_pb.TransferId(request_id="req-1", generation=1))
            assert (await stub.Prefill(request, metadata=metadata)).first_token == 7
            assert (await stub.Health(pb.HealthRequest(), metadata=metadata)).ready
        span.end()
        return dict(metadata)["traceparent"].split("-")[1]
    finally:
        await srv.stop(0)


def test_the_context_crosses_a_grpc_call_to_the_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = OTLPReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    router, prefill = Tracing.from_env("router"), Tracing.from_env("prefill")
    try:
        trace_id = asyncio.run(_call_through_traced_server(router, prefill))
        router.shutdown()
        prefill.shutdown()
        spans = receiver.wait_for(lambda got: len(got) >= 2)
    finally:
        receiver.stop()
    (root,) = [s for s in spans if s.service == "glmserve-router"]
    (served,) = [s for s in spans if s.service == "glmserve-prefill"]
    assert root.name == "glmserve.request" and root.trace_id == trace_id and root.parent_id == ""
    assert root.attributes == {"glmserve.request_id": "req-1", "glmserve.prompt_tokens": 3}
    assert served.name == "/glmserve.prefill.v1.Prefill/Prefill" and served.kind == "SERVER"
    assert served.trace_id == trace_id and served.parent_id == root.span_id
    assert len(spans) == 2, "the Health call is not traced"
