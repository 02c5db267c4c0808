"""The router's HTTP surface: a thin FastAPI adapter over `openai_protocol` (parsing, shapes),
`serving` (running a request) and a `GenerationBackend`.

Order of checks on the generation routes: API key (401), JSON (400), model (404), fields (400),
backend readiness (503), chat template and tokenization off the event loop (400 on a bad chat),
context length (400); only then does the backend see the request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from glmserve.services.router import openai_protocol as proto
from glmserve.services.router import openai_responses as resp
from glmserve.services.router import serving
from glmserve.services.router.backend import GenerationBackend, RequestHints
from glmserve.services.router.errors import (
    APIError,
    from_value_error,
    internal_error,
    method_not_allowed,
    not_found,
    service_unavailable,
    unauthorized,
)
from glmserve.services.router.metrics import RouterMetrics
from glmserve.services.router.output_processor import OutputProcessor
from glmserve.services.router.request_hints import request_hints
from glmserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bodies above this are parsed in a worker thread: a 100K-token prompt is ~0.5 MB of JSON.
_PARSE_OFF_LOOP_BYTES = 64 * 1024
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(
    backend: GenerationBackend,
    tokenizer: Tokenizer,
    model_name: str,
    api_keys: Sequence[str] | None = None,
    *,
    max_context: int,
) -> FastAPI:
    """An OpenAI-compatible app serving ``model_name`` through ``backend``.

    ``max_context``: the model's `max_position_embeddings` (prompt + max_tokens must fit).
    ``api_keys``: when non-empty, `/v1/*` needs `Authorization: Bearer <one of them>`; `/health`,
    `/ready` and `/metrics` stay open (probes and scrapers carry no keys).
    The backend is started and closed by the app's lifespan.
    """
    if max_context < 2:
        raise ValueError(f"max_context: must be >= 2, got {max_context}")
    keys = tuple(k.encode() for k in api_keys or ())
    metrics = RouterMetrics(model_name)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The detokenizer's byte table is built on first use (~0.3 s for a 150K vocab): not on the loop.
        await asyncio.to_thread(tokenizer.token_bytes, 0)
        await backend.start()
        try:
            yield
        finally:
            await backend.close()

    app = FastAPI(title="glmserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.state.backend = backend

    def authorize(request: Request) -> None:
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest against every key: the time taken does not reveal which prefix matched.
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(token.strip().encode(), k) for k in keys
        ):
            raise unauthorized()

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > _PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(proto.parse_json_body, raw)
        return proto.parse_json_body(raw)

    def admit() -> None:
        if not backend.ready():
            metrics.rejected("no_worker")
            raise service_unavailable()

    def hints_of(request: Request, body: dict[str, Any]) -> RequestHints:
        # Keys configured: authorize() already checked this one, so it names the tenant.
        token = request.headers.get("authorization", "").partition(" ")[2].strip() if keys else None
        return request_hints(request.headers, body, token)

    async def run(
        request: Request,
        arrival: float,
        rid: str,
        prompt_ids: list[int],
        options: proto.GenerationOptions,
        param: str,
        tools: list[dict[str, Any]] | None,
        hints: RequestHints,
        whole: Callable[[serving.Generation, serving.Collected], dict[str, Any]],
        streamed: Callable[[serving.Generation, OutputProcessor], AsyncIterator[str]],
    ) -> Response:
        params = options.sampling_params(len(prompt_ids), max_context, param)
        gen = serving.Generation(backend, metrics, rid, prompt_ids, params, request.receive, arrival, hints,
                                 request.url.path)
        processor = OutputProcessor(tokenizer, params, keep_tool_markup=tools is not None)
        if options.stream:
            return StreamingResponse(
                streamed(gen, processor), media_type="text/event-stream", headers=_SSE_HEADERS
            )
        try:
            collected = await serving.collect(gen, processor)
        except APIError as err:  # counted by the tracker already
            return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)
        if collected.finish_reason is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(whole(gen, collected))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        body = await body_of(request)
        req = proto.parse_chat_request(body)
        proto.check_model(req.options, model_name)
        hints = hints_of(request, body)
        admit()
        try:
            prompt_ids = await asyncio.to_thread(tokenizer.apply_chat_template, req.messages, req.tools)
        except ValueError as e:
            raise from_value_error(e, "messages") from e
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        return await run(
            request,
            arrival,
            rid,
            prompt_ids,
            req.options,
            "messages",
            req.tools,
            hints,
            lambda g, c: serving.chat_response(g, c, req.tools, rid, created, model_name),
            lambda g, p: serving.chat_stream(
                g, p, req.tools, req.options.include_usage, rid, created, model_name
            ),
        )

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        body = await body_of(request)
        req = proto.parse_completion_request(body, tokenizer.vocab_size)
        proto.check_model(req.options, model_name)
        hints = hints_of(request, body)
        admit()
        prompt = req.prompt
        prompt_ids = await asyncio.to_thread(tokenizer.encode, prompt) if isinstance(prompt, str) else prompt
        if not prompt_ids:
            raise from_value_error(ValueError("prompt: the prompt has no tokens"))
        rid = f"cmpl-{uuid.uuid4().hex}"
        return await run(
            request,
            arrival,
            rid,
            prompt_ids,
            req.options,
            "prompt",
            None,
            hints,
            lambda g, c: serving.completion_response(g, c, rid, created, model_name),
            lambda g, p: serving.completion_stream(g, p, req.options.include_usage, rid, created, model_name),
        )

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return resp.model_list(model_name, created, max_context)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        detail = backend.readiness_detail()
        if backend.ready():
            return JSONResponse({"status": "ready", **detail})
        return JSONResponse({"status": "not ready", **detail}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        extra = backend.metrics_registry()  # distinct metric names: two expositions concatenate into one
        body, content_type = metrics.render(*([extra] if extra is not None else []))
        return Response(body, media_type=content_type)

    _install_error_handlers(app, metrics)
    return app


def _install_error_handlers(app: FastAPI, metrics: RouterMetrics) -> None:
    def answer(request: Request, err: APIError) -> JSONResponse:
        metrics.count(err.status, request.url.path)
        return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return answer(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 405:
            return answer(request, method_not_allowed(request.method, request.url.path))
        if err.status_code == 404:
            return answer(request, not_found(request.url.path))
        return answer(request, APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=err)
        return answer(request, internal_error("internal server error"))
