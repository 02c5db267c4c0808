"""Serving one accepted request: drive the backend stream, watch the client, keep the metrics, and
shape the output as a whole OpenAI response or as SSE chunks.

Cancellation: a watcher task reads the ASGI `receive` channel; on `http.disconnect` it aborts the
request in the backend at once, even while no token is due (a long prefill). A stream closed any
other way (the router stopping at a stop string, cancellation, an error) aborts in `finally`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.services.router import openai_responses as resp
from glmserve.services.router.backend import (
    BackendUnavailable,
    GenerationBackend,
    RequestHints,
)
from glmserve.services.router.errors import APIError, internal_error, service_unavailable
from glmserve.services.router.metrics import RouterMetrics
from glmserve.services.router.output_processor import OutputProcessor, TokenLogprob
from glmserve.text.tool_calls import ParsedOutput, ToolCallStreamParser, parse_tool_calls

Receive = Callable[[], Awaitable[dict[str, Any]]]


class Generation:
    """One request's run through the backend; iterate `events()` once."""

    def __init__(
        self,
        backend: GenerationBackend,
        metrics: RouterMetrics,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        receive: Receive,
        arrival: float,
        hints: RequestHints | None = None,
        path: str = "",
    ):
        self.hints, self.path = hints, path
        self.backend, self.metrics, self.request_id = backend, metrics, request_id
        self.prompt_ids, self.params, self._receive, self.arrival = prompt_ids, params, receive, arrival
        self.disconnected = False
        self.stopped_by_router = False  # set before closing early on purpose (a stop string matched)

    async def _watch(self) -> None:
        try:
            while (await self._receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a broken channel means the client is gone as well
            pass
        self.disconnected = True
        await self.backend.abort(self.request_id)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The backend's events; raises `APIError` on a backend failure; ends quietly (with
        `disconnected` set) when the client went away."""
        # Tracked from here, not from construction: a stream that never starts holds nothing.
        tracker = self.metrics.track(len(self.prompt_ids), self.arrival, self.path)
        watcher = asyncio.create_task(self._watch())
        status: int | None = None  # an error status; else decided in `finally`
        finished = False
        try:
            stream = self.backend.generate(self.request_id, self.prompt_ids, self.params, self.hints)
            async with aclosing(stream):
                async for event in stream:
                    tracker.on_tokens(len(event.token_ids))
                    finished = event.finished
                    if finished:
                        self.metrics.finished(event.finish_reason)
                    if event.finish_reason == "error":
                        status = 500
                        raise internal_error(f"generation failed: {event.error}")
                    if event.finish_reason == "abort":
                        if not self.disconnected:
                            status = 503
                            raise service_unavailable("the request was aborted by the server")
                        return
                    yield event
        except BackendUnavailable as e:
            status = 503
            raise service_unavailable(str(e)) from e
        finally:
            watcher.cancel()
            if not finished:
                with anyio.CancelScope(shield=True):  # must reach the backend even when cancelled
                    await self.backend.abort(self.request_id)
            ok = finished or self.stopped_by_router
            tracker.finish(status or (200 if ok and not self.disconnected else 499))


@dataclass
class Collected:
    processor: OutputProcessor
    logprobs: list[TokenLogprob]
    finish_reason: str | None  # None: the client went away


async def collect(gen: Generation, processor: OutputProcessor) -> Collected:
    """Run a request to its end, for a non-streaming answer."""
    logprobs: list[TokenLogprob] = []
    async with aclosing(gen.events()) as events:
        async for event in events:
            logprobs += processor.push(event).logprobs
            gen.stopped_by_router = processor.stopped_by_text
            if event.finished or processor.stopped_by_text:
                return Collected(
                    processor, logprobs, "stop" if processor.stopped_by_text else event.finish_reason
                )
    return Collected(processor, logprobs, None)


def _finish_reason(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_response(
    gen: Generation, out: Collected, tools: list[dict[str, Any]] | None, rid: str, created: int, model: str
) -> dict[str, Any]:
    parsed = parse_tool_calls(out.processor.text, tools) if tools else ParsedOutput(out.processor.text)
    logprobs = resp.chat_logprobs(out.logprobs) if gen.params.logprobs is not None else None
    usage = resp.usage(len(gen.prompt_ids), out.processor.num_generated, out.processor.num_cached_tokens)
    content = parsed.content if parsed.content or not parsed.tool_calls else None
    return resp.chat_completion(
        rid,
        created,
        model,
        content,
        parsed.tool_calls,
        _finish_reason(out.finish_reason, bool(parsed.tool_calls)),
        usage,
        logprobs,
    )


def completion_response(
    gen: Generation, out: Collected, rid: str, created: int, model: str
) -> dict[str, Any]:
    logprobs = resp.completion_logprobs(out.logprobs, 0) if gen.params.logprobs is not None else None
    usage = resp.usage(len(gen.prompt_ids), out.processor.num_generated, out.processor.num_cached_tokens)
    return resp.completion(rid, created, model, out.processor.text, out.finish_reason, logprobs, usage)


async def _stream_deltas(
    gen: Generation, processor: OutputProcessor
) -> AsyncIterator[tuple[str, list, str | None]]:
    """(text, logprobs, finish_reason) per backend event; finish_reason set on the last one."""
    async with aclosing(gen.events()) as events:
        async for event in events:
            delta = processor.push(event)
            gen.stopped_by_router = processor.stopped_by_text
            if processor.stopped_by_text:
                yield delta.text, delta.logprobs, "stop"
                return
            yield delta.text, delta.logprobs, event.finish_reason if event.finished else None


async def chat_stream(
    gen: Generation,
    processor: OutputProcessor,
    tools: list[dict[str, Any]] | None,
    include_usage: bool,
    rid: str,
    created: int,
    model: str,
) -> AsyncIterator[str]:
    """SSE lines of a streamed chat completion, ending `data: [DONE]` (or an error event)."""
    parser = ToolCallStreamParser(tools) if tools else None
    has_calls, finish = False, None
    yield resp.sse(resp.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
    try:
        async with aclosing(_stream_deltas(gen, processor)) as deltas:
            async for text, logprobs, finish in deltas:
                content, calls = text, []
                if parser is not None:  # tool-call markup becomes `tool_calls` once a call closes
                    parts = [parser.feed(text)] + ([parser.finish()] if finish is not None else [])
                    content = "".join(p.content for p in parts)
                    calls = [c for p in parts for c in p.tool_calls]
                has_calls = has_calls or bool(calls)
                if content or calls or logprobs:
                    delta: dict[str, Any] = {"content": content} if content or not calls else {}
                    if calls:
                        delta["tool_calls"] = calls
                    lp = resp.chat_logprobs(logprobs) if gen.params.logprobs is not None else None
                    yield resp.sse(resp.chat_chunk(rid, created, model, delta, None, lp))
    except APIError as e:
        yield resp.error_event(e)
        yield resp.SSE_DONE
        return
    if finish is None:
        return  # the client went away
    yield resp.sse(resp.chat_chunk(rid, created, model, {}, _finish_reason(finish, has_calls)))
    if include_usage:
        usage = resp.usage(len(gen.prompt_ids), processor.num_generated, processor.num_cached_tokens)
        yield resp.sse(resp.usage_chunk(rid, created, model, "chat.completion.chunk", usage))
    yield resp.SSE_DONE


async def completion_stream(
    gen: Generation, processor: OutputProcessor, include_usage: bool, rid: str, created: int, model: str
) -> AsyncIterator[str]:
    """SSE lines of a streamed legacy completion."""
    finish, offset = None, 0
    try:
        async with aclosing(_stream_deltas(gen, processor)) as deltas:
            async for text, logprobs, finish in deltas:
                if text or logprobs or finish:
                    lp = (
                        resp.completion_logprobs(logprobs, offset)
                        if gen.params.logprobs is not None
                        else None
                    )
                    yield resp.sse(resp.completion(rid, created, model, text, finish, lp))
                offset += len(text)
    except APIError as e:
        yield resp.error_event(e)
        yield resp.SSE_DONE
        return
    if finish is None:
        return
    if include_usage:
        usage = resp.usage(len(gen.prompt_ids), processor.num_generated, processor.num_cached_tokens)
        yield resp.sse(resp.usage_chunk(rid, created, model, "text_completion", usage))
    yield resp.SSE_DONE
