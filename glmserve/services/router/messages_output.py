"""An Anthropic Messages answer put together from a chat answer's pieces (`chat_pieces`), with the
stream events that tell a client how it grows, and Anthropic's error shape.

Content blocks: a ``thinking`` block for the reasoning (no signature: nothing here checks one), a
``text`` block for each run of text, a ``tool_use`` block for each tool call, in the order the
model wrote them. Events: ``message_start``; per block ``content_block_start``,
``content_block_delta`` (``thinking_delta`` / ``text_delta`` / ``input_json_delta``)...,
``content_block_stop``; then
``message_delta`` (``stop_reason``, ``stop_sequence``, usage) and ``message_stop``; or an
``error`` event. ``stop_reason``: ``end_turn``, ``max_tokens``, ``stop_sequence`` or ``tool_use``.
Usage as Anthropic counts it: ``input_tokens`` are the prompt tokens not read from the prefix
cache, ``cache_read_input_tokens`` the ones that were.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from glmserve.services.router.chat_pieces import (
    CallArguments,
    CallStarted,
    Finished,
    Piece,
    ReasoningPiece,
    TextPiece,
    cached_tokens,
)
from glmserve.services.router.errors import APIError

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(err: APIError) -> dict[str, Any]:
    return error_body(err.status, err.message)


def usage(num_prompt: int, num_cached: int, num_output: int) -> dict[str, Any]:
    return {"input_tokens": num_prompt - num_cached, "output_tokens": num_output,
            "cache_read_input_tokens": num_cached, "cache_creation_input_tokens": 0}


def stop_reason(finish: Finished) -> str:
    if finish.reason == "tool_calls":
        return "tool_use"
    if finish.reason == "length":
        return "max_tokens"
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"


class MessageAssembly:
    """One answer's content, grown piece by piece (`feed` returns the events each piece makes)."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self.content: list[dict[str, Any]] = []
        self._arguments: dict[int, str] = {}  # block index -> a tool_use's JSON so far
        self._calls: dict[int, int] = {}  # chat call index -> block index
        self._open: int | None = None  # the block being written
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] = usage(0, 0, 0)

    def message(self) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": self.usage}

    def start(self, num_prompt: int, num_cached: int) -> list[dict[str, Any]]:
        self.usage = usage(num_prompt, num_cached, 0)
        return [{"type": "message_start", "message": self.message()}]

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        if isinstance(piece, TextPiece):
            return self._text("text", piece.text)
        if isinstance(piece, ReasoningPiece):
            return self._text("thinking", piece.text)
        if isinstance(piece, CallStarted):
            return self._call_started(piece)
        if isinstance(piece, CallArguments):
            return self._call_arguments(piece)
        if isinstance(piece, Finished):
            return self._finished(piece)
        status = {"invalid_request_error": 400, "service_unavailable_error": 503}.get(piece.error.get("type"), 500)
        return [error_body(status, piece.error.get("message", "generation failed"))]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        if index in self._arguments:
            self.content[index]["input"] = _object(self._arguments[index])
        return [{"type": "content_block_stop", "index": index}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """A piece of a ``text`` or a ``thinking`` block (its text is in the field of that name)."""
        events = []
        if self._open is None or self.content[self._open]["type"] != kind:
            events += self._close()
            self._open = len(self.content)
            block = {"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})}
            self.content.append(block)
            events.append({"type": "content_block_start", "index": self._open, "content_block": dict(block)})
        self.content[self._open][kind] += text
        return events + [{"type": "content_block_delta", "index": self._open,
                          "delta": {"type": f"{kind}_delta", kind: text}}]

    def _call_started(self, piece: CallStarted) -> list[dict[str, Any]]:
        events = self._close()
        index = self._open = self._calls[piece.index] = len(self.content)
        block = {"type": "tool_use", "id": piece.call_id or f"toolu_{secrets.token_hex(12)}", "name": piece.name,
                 "input": {}}
        self.content.append(block)
        self._arguments[index] = ""
        return events + [{"type": "content_block_start", "index": index, "content_block": dict(block)}]

    def _call_arguments(self, piece: CallArguments) -> list[dict[str, Any]]:
        index = self._calls[piece.index]
        self._arguments[index] += piece.piece
        if index != self._open:  # blocks stream one after another; the parser never interleaves calls
            log.warning("arguments for a closed tool_use block %d dropped from the stream", index)
            self.content[index]["input"] = _object(self._arguments[index])
            return []
        return [{"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": piece.piece}}]

    def _finished(self, piece: Finished) -> list[dict[str, Any]]:
        events = self._close()
        self.stop_reason, self.stop_sequence = stop_reason(piece), piece.stop_sequence
        chat = piece.usage
        self.usage = usage(chat.get("prompt_tokens", 0), cached_tokens(chat), chat.get("completion_tokens", 0))
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                          "usage": self.usage},
                         {"type": "message_stop"}]


def _object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (the parser only reports calls whose arguments are one)."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
