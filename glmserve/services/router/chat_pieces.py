"""A chat completion's answer read as the pieces the agent APIs (`/v1/responses`, `/v1/messages`)
are built from: reasoning (``reasoning_content``), text, tool calls (started, then argument
pieces), and how it finished.

Both APIs are adapters over the chat path (same template, same `RequestRun`, so the same prefix
caching, sessions and admission); they read its answer, whole (`whole_pieces`) or streamed
(`stream_pieces`), and only reshape it. The stream reader takes calls in either streaming shape:
whole calls in one delta, or a first delta with ``id`` and ``name`` followed by argument pieces.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from glmserve.services.router.request_run import RequestRun


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class ReasoningPiece:
    """Reasoning the model wrote before its answer (the chat answer's ``reasoning_content``)."""

    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    piece: str


@dataclass(frozen=True)
class Finished:
    """``reason``: the chat ``finish_reason`` (stop, length, tool_calls); ``stop_sequence``: the
    stop string that ended the text (None when an end token or a length did); ``usage``: chat usage."""

    reason: str
    stop_sequence: str | None
    usage: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """The OpenAI error object (``{"message", "type", "param", "code"}``) a stream ended with."""

    error: dict[str, Any]


Piece = ReasoningPiece | TextPiece | CallStarted | CallArguments | Finished | Failed


def stop_sequence(run: RequestRun | None) -> str | None:
    """The stop string that ended ``run``'s text, if one did."""
    reason = run.output.stop_reason if run is not None else None
    return reason if isinstance(reason, str) else None


async def stream_pieces(chunks: AsyncIterator[dict[str, Any]], run: RequestRun) -> AsyncIterator[Piece]:
    """The pieces of a streamed chat answer (``stream_options.include_usage`` set). Ends without
    `Finished` when the client went away."""
    started: set[int] = set()
    finish, usage = None, None
    async with aclosing(chunks):
        async for chunk in chunks:
            if "error" in chunk:
                yield Failed(chunk["error"])
                return
            if not chunk.get("choices"):  # the usage chunk, after the finish
                usage = chunk.get("usage")
                continue
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield ReasoningPiece(delta["reasoning_content"])
            if delta.get("content"):
                yield TextPiece(delta["content"])
            for call in delta.get("tool_calls") or []:
                index, fn = call.get("index", 0), call.get("function") or {}
                if index not in started:
                    started.add(index)
                    yield CallStarted(index, call.get("id") or "", fn.get("name") or "")
                if fn.get("arguments"):
                    yield CallArguments(index, fn["arguments"])
            finish = choice.get("finish_reason") or finish
    if finish is not None:
        yield Finished(finish, stop_sequence(run), usage or {})


def whole_pieces(body: dict[str, Any], run: RequestRun | None) -> list[Piece]:
    """The pieces of a whole chat completion body."""
    choice = body["choices"][0]
    message = choice["message"]
    pieces: list[Piece] = [ReasoningPiece(message["reasoning_content"])] if message.get("reasoning_content") else []
    pieces += [TextPiece(message["content"])] if message.get("content") else []
    for index, call in enumerate(message.get("tool_calls") or []):
        pieces.append(CallStarted(index, call["id"], call["function"]["name"]))
        pieces.append(CallArguments(index, call["function"]["arguments"]))
    pieces.append(Finished(choice["finish_reason"], stop_sequence(run), body["usage"]))
    return pieces


def cached_tokens(usage: dict[str, Any]) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
