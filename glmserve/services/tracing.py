"""OpenTelemetry traces of a request across processes: router -> decode -> prefill. Off by default.

On when the standard variables name an OTLP endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``), unless ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``.
Each process then has its own tracer provider: ``service.name`` from ``OTEL_SERVICE_NAME`` (else
``glmserve-<role>``), the sampler from ``OTEL_TRACES_SAMPLER[_ARG]``, batched OTLP/gRPC export set up
by ``OTEL_EXPORTER_OTLP_*`` and ``OTEL_BSP_*`` (the helm chart sets them), flushed at exit.

Spans of one request: the router's ``glmserve.request`` (request id, prompt tokens, each attempt's
decode and prefill worker, finish reason), decode's server span of ``Decode/Generate`` (the whole
stream), and the client and server spans of the ``Prefill/Prefill`` and ``Prefill/Abort`` calls
decode makes. The W3C trace context travels in each call's gRPC metadata (``traceparent``): the
router puts its span's there (`RequestSpan.metadata`), decode's client interceptors theirs, server
interceptors read it (opentelemetry-instrumentation-grpc). Health calls are not traced. Off: no
interceptors, no spans, and the SDK, exporter and instrumentation are never imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TRACED_METHODS = ("Generate", "Prefill", "Abort")  # the calls that carry a request
_OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


@dataclass(frozen=True)
class TracingConfig:
    """Whether and as what this process traces; ``service_name`` None: off."""

    service_name: str | None = None

    @property
    def enabled(self) -> bool:
        return self.service_name is not None

    @classmethod
    def from_env(cls, role: str, env: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if env is None else env
        if not any(env.get(name) for name in _OTLP_ENDPOINTS):
            return cls()
        if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER") == "none":
            return cls()
        exporter = env.get("OTEL_TRACES_EXPORTER", "otlp")
        if exporter != "otlp":
            raise ValueError(f"OTEL_TRACES_EXPORTER: only otlp (or none) is supported, got {exporter!r}")
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        if protocol != "grpc":
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: only grpc is supported, got {protocol!r}")
        return cls(env.get("OTEL_SERVICE_NAME") or f"glmserve-{role}")


class RequestSpan:
    """The router's span of one request. This base class is the span of a process that does not
    trace: every method does nothing."""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata that makes the called service's span a child of this one."""
        return ()

    def attempt(self, **attributes: Any) -> None:
        """An ``attempt`` event: the request is sent (again) with these ``glmserve.<key>`` attributes."""

    def set(self, **attributes: Any) -> None:
        """Attributes, named ``glmserve.<key>``."""

    def end(self, error: str | None = None) -> None:
        """Once, when the request ended; ``error``: why it failed."""


class _LiveRequestSpan(RequestSpan):
    def __init__(self, span: Any) -> None:
        self._span = span

    def metadata(self) -> tuple[tuple[str, str], ...]:
        from opentelemetry import propagate, trace

        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self._span))
        return tuple(carrier.items())

    def attempt(self, **attributes: Any) -> None:
        self._span.add_event("attempt", _named(attributes))

    def set(self, **attributes: Any) -> None:
        self._span.set_attributes(_named(attributes))

    def end(self, error: str | None = None) -> None:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


class Tracing:
    """One process's tracing (see the module docstring); ``Tracing()`` is off."""

    def __init__(self, config: TracingConfig | None = None) -> None:
        self.config = config or TracingConfig()
        self._provider = _provider(self.config.service_name) if self.config.enabled else None

    @classmethod
    def from_env(cls, role: str) -> Tracing:
        return cls(TracingConfig.from_env(role))

    def server_interceptors(self) -> list[Any]:
        """For ``grpc.aio.server(interceptors=...)``."""
        if self._provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [aio_server_interceptor(self._provider, filter_=_traced_call())]

    def client_interceptors(self) -> list[Any]:
        """For ``grpc.aio.insecure_channel(..., interceptors=...)``; the client spans carry the
        request id of the call's ``transfer``."""
        if self._provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        return aio_client_interceptors(self._provider, filter_=_traced_call(), request_hook=_request_attributes)

    def start_request(self, request_id: str, **attributes: Any) -> RequestSpan:
        """The root span of one request; end it with `RequestSpan.end`."""
        if self._provider is None:
            return RequestSpan()
        from opentelemetry.trace import SpanKind

        span = self._provider.get_tracer("glmserve").start_span("glmserve.request", kind=SpanKind.INTERNAL)
        live = _LiveRequestSpan(span)
        live.set(request_id=request_id, **attributes)
        return live

    def shutdown(self) -> None:
        """Export what is buffered and stop (also done at exit)."""
        if self._provider is not None:
            self._provider.shutdown()


def _provider(service_name: str) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


def _named(attributes: dict[str, Any]) -> dict[str, Any]:
    return {f"glmserve.{k}": v for k, v in attributes.items() if v is not None}


def _traced_call() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.any_of(*(filters.method_name(name) for name in TRACED_METHODS))


def _request_attributes(span: Any, request: Any) -> None:
    transfer = getattr(request, "transfer", None)
    if transfer is not None and span.is_recording():
        span.set_attributes({"glmserve.request_id": transfer.request_id, "glmserve.generation": transfer.generation})
