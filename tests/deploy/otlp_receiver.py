"""A real OTLP/gRPC trace receiver for tests: the collector's ``TraceService.Export`` on 127.0.0.1,
keeping every span it is sent with the ``service.name`` of the process that sent it."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: str  # SERVER, CLIENT, INTERNAL, ...
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, object]
    error: bool


def _value(v) -> object:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class OTLPReceiver(pb_grpc.TraceServiceServicer):
    """Serves on ``127.0.0.1:port`` once started; ``endpoint`` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server.start()

    def Export(self, request: pb.ExportTraceServiceRequest, context: grpc.ServicerContext):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=str(resource.get("service.name")), name=s.name,
                        kind=trace_pb2.Span.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        error=s.status.code == trace_pb2.Status.STATUS_CODE_ERROR))
        with self._lock:
            self._spans.extend(received)
        return pb.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate, timeout_s: float = 30) -> list[ReceivedSpan]:
        """The spans once ``predicate(spans)`` holds; fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not predicate(spans := self.spans()):
            assert time.monotonic() < deadline, f"spans never matched; got {[(s.service, s.name) for s in spans]}"
            time.sleep(0.2)
        return spans

    def stop(self) -> None:
        self._server.stop(1).wait()
