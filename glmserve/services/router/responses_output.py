"""A Response object (the OpenAI Responses API) put together from a chat answer's pieces
(`chat_pieces`), with the stream events that tell a client how it grows.

Output items: a ``reasoning`` item (one ``reasoning_text`` part) for the reasoning, a ``message``
(one ``output_text`` part) for each run of text, a ``function_call`` for each tool call, in the
order the model wrote them. Events, as the OpenAI API sends them:
``response.created``, ``response.in_progress``; per item ``response.output_item.added``, then for
reasoning ``response.reasoning_text.delta``..., ``.done``, for a message
``response.content_part.added``, ``response.output_text.delta``..., ``.done``,
``response.content_part.done``, and for a call ``response.function_call_arguments.delta``...,
``.done``; ``response.output_item.done``; last ``response.completed`` (``response.incomplete``
when the output hit ``max_output_tokens``), or ``error`` and ``response.failed``. Every event has
a ``sequence_number``. A whole answer is the same assembly with its events dropped.
"""

from __future__ import annotations

import secrets
from typing import Any

from glmserve.services.router.agent_chat import tool_call
from glmserve.services.router.chat_pieces import (
    CallArguments,
    CallStarted,
    Failed,
    Finished,
    Piece,
    ReasoningPiece,
    TextPiece,
    cached_tokens,
)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat usage in the Responses' shape."""
    num_in, num_out = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    return {"input_tokens": num_in, "input_tokens_details": {"cached_tokens": cached_tokens(chat_usage)},
            "output_tokens": num_out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_in + num_out}


class ResponseAssembly:
    """One response's output, grown piece by piece (`feed` returns the events each piece makes)."""

    def __init__(self, response_id: str, created_at: int, model: str, echo: dict[str, Any]) -> None:
        self.response_id, self.created_at, self.model, self.echo = response_id, created_at, model, echo
        self.output: list[dict[str, Any]] = []
        self._text: int | None = None  # output index of the open message item
        self._reasoning: int | None = None  # ... of the open reasoning item
        self._calls: dict[int, int] = {}  # open calls: chat call index -> output index
        self._seq = 0
        self.status, self.usage = "in_progress", None
        self.error: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None

    def response(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "status": self.status, "model": self.model, "output": self.output, "usage": self.usage,
                "error": self.error, "incomplete_details": self.incomplete, **self.echo}

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        if isinstance(piece, ReasoningPiece):
            return self._close_text() + self._reasoning_piece(piece.text)
        if isinstance(piece, CallArguments):
            return self._call_arguments(piece)
        events = self._close_reasoning()
        if isinstance(piece, TextPiece):
            return events + self._text_piece(piece.text)
        if isinstance(piece, CallStarted):
            return events + self._close_text() + self._call_started(piece)
        if isinstance(piece, Finished):
            return events + self._finished(piece)
        return events + self._failed(piece)

    def assistant_message(self) -> dict[str, Any]:
        """The output as one chat assistant message (what the next turn's prompt holds)."""
        text = "".join(part["text"] for item in self.output if item["type"] == "message"
                       for part in item["content"])
        calls = [tool_call(item["call_id"], item["name"], item["arguments"])
                 for item in self.output if item["type"] == "function_call"]
        reasoning = "".join(part["text"] for item in self.output if item["type"] == "reasoning"
                            for part in item["content"])
        content = text or (None if calls else "")  # a chat assistant message has text, calls, or both
        # The reasoning too: the template shows it while a tool loop runs (then drops it).
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {}),
                **({"reasoning_content": reasoning} if reasoning else {})}

    # --- the pieces ------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _text_piece(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._text is None:
            self._text = len(self.output)
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []}
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=self._text, item=dict(item)))
            item["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._text,
                                      content_index=0, part=dict(item["content"][0])))
        item = self.output[self._text]
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._text,
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _reasoning_piece(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._reasoning is None:
            self._reasoning = len(self.output)
            item = {"type": "reasoning", "id": _id("rs"), "status": "in_progress", "summary": [], "content": []}
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=self._reasoning, item=dict(item)))
            item["content"] = [{"type": "reasoning_text", "text": ""}]
        item = self.output[self._reasoning]
        item["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", item_id=item["id"], output_index=self._reasoning,
                                     content_index=0, delta=text)]

    def _close_reasoning(self) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return []
        index, self._reasoning = self._reasoning, None
        item = self.output[index]
        item["status"] = "completed"
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=item["content"][0]["text"]),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

    def _close_text(self, status: str = "completed") -> list[dict[str, Any]]:
        if self._text is None:
            return []
        index, self._text = self._text, None
        item = self.output[index]
        item["status"] = status
        part = item["content"][0]
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=dict(item))]

    def _call_started(self, piece: CallStarted) -> list[dict[str, Any]]:
        index = self._calls[piece.index] = len(self.output)
        item = {"type": "function_call", "id": _id("fc"), "call_id": piece.call_id or _id("call"),
                "name": piece.name, "arguments": "", "status": "in_progress"}
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=index, item=dict(item))]

    def _call_arguments(self, piece: CallArguments) -> list[dict[str, Any]]:
        index = self._calls[piece.index]
        item = self.output[index]
        item["arguments"] += piece.piece
        return [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=piece.piece)]

    def _close_calls(self, status: str) -> list[dict[str, Any]]:
        events = []
        for index in self._calls.values():
            item = self.output[index]
            item["status"] = status
            events += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=dict(item))]
        self._calls = {}
        return events

    def _finished(self, piece: Finished) -> list[dict[str, Any]]:
        status = "incomplete" if piece.reason == "length" else "completed"
        events = self._close_text(status) + self._close_calls(status)
        self.status, self.usage = status, usage(piece.usage)
        if status == "incomplete":
            self.incomplete = {"reason": "max_output_tokens"}
        return events + [self._event(f"response.{status}", response=self.response())]

    def _failed(self, piece: Failed) -> list[dict[str, Any]]:
        error = piece.error
        self.status = "failed"
        self.error = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        return [self._event("error", code=error.get("code"), message=error.get("message", ""),
                            param=error.get("param")),
                self._event("response.failed", response=self.response())]
