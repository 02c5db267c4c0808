"""The router's HTTP surface: FastAPI routes as thin adapters over the transport-free serving layer
(`serving.OpenAIServing`), and the app around them (lifespan, API keys, probes, metrics, errors).

A generation route: API key (401), then the body parsed into its pydantic model (400 naming the
field; off the event loop when large), then the serving layer answers (`serving`'s docstring has the
order of its checks). ``/openapi.json`` documents the request bodies (`openai_requests`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from glmserve.services.router import completion_bodies as bodies
from glmserve.services.router.access_log import AccessLog
from glmserve.services.router.admission import AdmissionConfig
from glmserve.services.router.backend import GenerationBackend
from glmserve.services.router.errors import (
    APIError,
    internal_error,
    invalid_request,
    method_not_allowed,
    not_found,
    unauthorized,
)
from glmserve.services.router.messages_api import MessagesAPI
from glmserve.services.router.messages_bodies import CountTokensRequest, MessagesRequest
from glmserve.services.router.messages_output import anthropic_error
from glmserve.services.router.metrics import RouterMetrics
from glmserve.services.router.openai_requests import (
    Body,
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from glmserve.services.router.openapi_answers import document_answers
from glmserve.services.router.request_hints import request_hints
from glmserve.services.router.request_id import RequestIdMiddleware
from glmserve.services.router.request_run import RequestContext
from glmserve.services.router.responses_api import ResponsesAPI
from glmserve.services.router.responses_bodies import ResponsesRequest
from glmserve.services.router.responses_items import DEFAULT_LIMIT, MAX_LIMIT
from glmserve.services.router.responses_store import MemoryResponseStore, ResponseStore
from glmserve.services.router.serving import Answer, OpenAIServing
from glmserve.services.router.tokenize_requests import DetokenizeRequest, TokenizeRequest
from glmserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bodies above this are parsed in a worker thread: a 100K-token prompt is ~0.5 MB of JSON.
_PARSE_OFF_LOOP_BYTES = 64 * 1024
DEFAULT_MAX_BODY_BYTES = 16 << 20  # room for a full context of text with its JSON escaping
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def create_app(
    backend: GenerationBackend,
    tokenizer: Tokenizer,
    model_name: str,
    api_keys: Sequence[str] | None = None,
    *,
    max_context: int,
    admission: AdmissionConfig | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    response_store: ResponseStore | None = None,
    separate_reasoning: bool = True,
) -> FastAPI:
    """An OpenAI-compatible app serving ``model_name`` through ``backend``.

    ``max_context``: the model's `max_position_embeddings` (prompt + max_tokens must fit).
    ``api_keys``: when non-empty, `/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer
    <one of them>` (or `x-api-key: <it>`); `/health`, `/ready`, `/metrics` and `/openapi.json` stay
    open (probes and scrapers carry no keys). Every answer carries ``x-request-id`` (`request_id`).
    ``admission``: the bounds of the admission queue (`AdmissionConfig`'s defaults when None).
    ``max_body_bytes``: a larger request body is refused with 413 before it is read whole.
    ``response_store``: where ``/v1/responses`` keeps stored responses (this process when None).
    ``separate_reasoning``: chat answers put `<think>` blocks into ``reasoning_content`` unless a
    request says otherwise (``--reasoning-parser glm45``, the default; False: ``none``).
    The backend is started and closed by the app's lifespan.
    """
    metrics = RouterMetrics(model_name)
    serving = OpenAIServing(backend, tokenizer, model_name, max_context, metrics, admission, separate_reasoning)
    store = response_store if response_store is not None else MemoryResponseStore()
    responses, messages = ResponsesAPI(serving, store), MessagesAPI(serving)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The detokenizer's byte table is built on first use (~0.3 s for a 150K vocab): not on the loop.
        await asyncio.to_thread(lambda: tokenizer.max_token_bytes)  # builds the byte table too
        await backend.start()
        try:
            yield
        finally:
            await backend.close()
            await store.close()

    app = FastAPI(title="glmserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics, app.state.backend, app.state.serving = metrics, backend, serving
    authorize = _authorizer(api_keys or ())

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        body = await _parse(request, ChatCompletionRequest, max_body_bytes, metrics)
        ctx = _context(request, body.user, body.priority, arrival, bool(api_keys))
        return _respond(request, await serving.chat(body, ctx))

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        body = await _parse(request, CompletionRequest, max_body_bytes, metrics)
        ctx = _context(request, body.user, body.priority, arrival, bool(api_keys))
        return _respond(request, await serving.completion(body, ctx))

    @app.post("/v1/responses", dependencies=[Depends(authorize)])
    async def create_response(request: Request) -> Response:
        arrival = time.monotonic()
        body = await _parse(request, ResponsesRequest, max_body_bytes, metrics)
        ctx = _context(request, body.session_user, 0, arrival, bool(api_keys))
        return _respond(request, await responses.create(body, ctx))

    def tenant(request: Request) -> str:
        return _tenant(_presented_key(request) if api_keys else None)

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorize)])
    async def get_response(request: Request, response_id: str) -> dict[str, Any]:
        return await responses.get(response_id, tenant(request))

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorize)])
    async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
        return await responses.delete(response_id, tenant(request))

    @app.get("/v1/responses/{response_id}/input_items", dependencies=[Depends(authorize)])
    async def list_input_items(
        request: Request, response_id: str, limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
        order: Literal["asc", "desc"] = "desc", after: str | None = None,
        include: Annotated[list[str] | None, Query(description="accepted; no item here has extra fields")] = None,
    ) -> dict[str, Any]:
        return await responses.input_items(response_id, tenant(request), limit, order, after)

    @app.post("/v1/messages", dependencies=[Depends(authorize)])
    async def create_message(request: Request) -> Response:
        arrival = time.monotonic()
        body = await _parse(request, MessagesRequest, max_body_bytes, metrics)
        ctx = _context(request, body.session_user, 0, arrival, bool(api_keys))
        return _respond(request, await messages.create(body, ctx))

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(authorize)])
    async def count_message_tokens(request: Request) -> dict[str, Any]:
        return await messages.count_tokens(await _parse(request, CountTokensRequest, max_body_bytes, metrics))

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str) -> dict[str, Any]:
        return serving.model(model_id)

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(request: Request) -> dict[str, Any]:
        return await serving.tokenize(await _parse(request, TokenizeRequest, max_body_bytes, metrics))

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(request: Request) -> dict[str, Any]:
        return await serving.detokenize(await _parse(request, DetokenizeRequest, max_body_bytes, metrics))

    _add_probes(app, backend, metrics, serving)
    _install_error_handlers(app, metrics)
    app.add_middleware(AccessLog)
    app.openapi = lambda: _openapi_with_bodies(app)  # type: ignore[method-assign]
    app.add_middleware(RequestIdMiddleware)
    return app


# --- the adapter: HTTP in, serving layer, HTTP out ---------------------------------------------------


async def _parse(request: Request, model: type[Body], limit: int, metrics: RouterMetrics) -> Body:
    raw = await _read_body(request, limit, metrics)
    if len(raw) > _PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_body, model, raw)
    return parse_body(model, raw)


async def _read_body(request: Request, limit: int, metrics: RouterMetrics) -> bytes:
    """The body, or 413 as soon as it is known to exceed ``limit`` (by its Content-Length, or
    while it arrives): a 50 MB body is not read, kept or parsed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, metrics)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, metrics)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int, metrics: RouterMetrics) -> APIError:
    metrics.rejected("too_large")
    return APIError(413, f"The request body is larger than {limit} bytes.", "invalid_request_error", None,
                    "request_too_large")


def _context(request: Request, user: str | None, priority: int, arrival: float, keyed: bool) -> RequestContext:
    """``user``: the body's end-user id (a session, unless ``x-session-id`` names one)."""
    # Keys configured: the authorizer already checked this one, so it names the tenant.
    token = _presented_key(request) if keyed else None

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    hints = request_hints(request.headers, user, token)
    return RequestContext(arrival, request.url.path, hints, disconnected, request.state.request_id, _tenant(token),
                          priority)


def _tenant(token: str | None) -> str:
    """Whose requests these are: a digest of the API key ("" without keys)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token is not None else ""


class _RunStream(StreamingResponse):
    """An SSE answer that closes its run however the response ends: also when the client left
    before the first chunk was sent (Starlette then never starts the body's iterator)."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(_sse(answer), media_type="text/event-stream", headers=_SSE_HEADERS)
        self._run = answer.run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._run is not None:
                await self._run.close()


def _respond(request: Request, answer: Answer) -> Response:
    request.state.run = answer.run  # its token counts, for the access log
    if answer.chunks is not None:
        return _RunStream(answer)
    if answer.body is None:
        return Response(status_code=answer.status)  # 499: the client is gone; nobody reads this
    return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers)


async def _sse(answer: Answer) -> AsyncIterator[str]:
    """Each chunk as one SSE event, then ``[DONE]`` (unless the client already left)."""
    assert answer.chunks is not None and answer.run is not None
    async for chunk in answer.chunks:
        yield bodies.named_sse(chunk) if answer.named_events else bodies.sse(chunk)
    if not answer.run.disconnected and not answer.named_events:
        yield bodies.SSE_DONE


def _presented_key(request: Request) -> str | None:
    """The API key a request carries: ``Authorization: Bearer <key>``, or ``x-api-key: <key>``
    (Anthropic's clients send that one)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return request.headers.get("x-api-key")


def _authorizer(api_keys: Sequence[str]) -> Callable[[Request], None]:
    keys = tuple(k.encode() for k in api_keys)

    def authorize(request: Request) -> None:
        if not keys:
            return
        token = _presented_key(request)
        # compare_digest against every key: the time taken does not reveal which prefix matched.
        if token is None or not any(hmac.compare_digest(token.encode(), k) for k in keys):
            raise unauthorized()

    return authorize


def _add_probes(app: FastAPI, backend: GenerationBackend, metrics: RouterMetrics, serving: OpenAIServing) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}  # the event loop answers: this process serves

    @app.get("/ready")
    async def ready() -> JSONResponse:
        detail = backend.readiness_detail()
        if serving.draining:
            return JSONResponse({"status": "draining", **detail}, status_code=503, headers={"Retry-After": "1"})
        if backend.ready():
            return JSONResponse({"status": "ready", **detail})
        return JSONResponse({"status": "not ready", **detail}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        extra = backend.metrics_registry()  # distinct metric names: two expositions concatenate into one
        body, content_type = metrics.render(*([extra] if extra is not None else []))
        return Response(body, media_type=content_type)


def _openapi_with_bodies(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with each generation route's request body (the routes read the raw body
    themselves, to parse large ones off the event loop) and what every route answers besides a 200
    (`openapi_answers`)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="1", routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODIES.items():
            body_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body_schema.pop("$defs", {}))
            components[model.__name__] = body_schema
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": ref}},
            }
        document_answers(schema, {path for path in BODIES if path.startswith("/v1/")})
        app.openapi_schema = schema
    return app.openapi_schema


def _install_error_handlers(app: FastAPI, metrics: RouterMetrics) -> None:
    def answer(request: Request, err: APIError) -> JSONResponse:
        metrics.count(err.status, request.url.path)
        if err.status == 400:
            metrics.rejected("invalid")
        if err.status < 500:  # a refusal; no message: it may quote the request
            log.info("refused %s %s: %d %s (param %s)", request.method, request.url.path, err.status,
                     err.code or err.type, err.param)
        # Anthropic's clients read their own error shape.
        body = anthropic_error(err) if request.url.path.startswith("/v1/messages") else err.to_dict()
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return answer(request, err)

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]  # a path or query parameter (bodies are parsed by the routes)
        param = str(first["loc"][-1])
        return answer(request, invalid_request(f"{param}: {first['msg']}", param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 405:  # with the route's Allow header (RFC 9110)
            refusal = method_not_allowed(request.method, request.url.path)
            refusal.headers.update(err.headers or {})
            return answer(request, refusal)
        if err.status_code == 404:
            return answer(request, not_found(request.url.path))
        return answer(request, APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=err)
        return answer(request, internal_error("internal server error"))
