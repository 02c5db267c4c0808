"""A stored response's input items (``GET /v1/responses/{id}/input_items``): the request's own
``input`` as Response items, each with an id, and the cursor-paged list object OpenAI answers with.

Items keep the id a client gave them (an item replayed from an earlier output) and get a fresh one
otherwise. Messages from the user, system or developer carry ``input_text`` parts; the assistant's
carry ``output_text`` parts, as OpenAI lists them. Only this request's input is listed, not the
conversation a ``previous_response_id`` brought in (that response lists its own).
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from glmserve.services.router.errors import invalid_request
from glmserve.services.router.responses_bodies import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputTextPart,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

MAX_LIMIT, DEFAULT_LIMIT = 100, 20
_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``body.input`` as Response items with unique ids, in the order it was sent."""
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    out: list[dict[str, Any]] = []
    taken: set[str] = set()
    for item in items:
        shaped = _shaped(item)
        given = getattr(item, "id", None)
        item_id = given if isinstance(given, str) and given and given not in taken else _fresh(item.type)
        taken.add(item_id)
        out.append({"id": item_id, **shaped})
    return out


def _shaped(item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem) -> dict[str, Any]:
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        return {"type": "message", "role": item.role, "status": "completed",
                "content": [_part(kind, text) for text in _texts(item.content)]}
    if isinstance(item, FunctionCallItem):
        return {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments,
                "status": "completed"}
    if isinstance(item, FunctionCallOutputItem):
        output: Any = item.output
        if not isinstance(output, str):
            output = [_part("input_text", text) for text in _texts(output)]
        return {"type": "function_call_output", "call_id": item.call_id, "output": output, "status": "completed"}
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": p.text} for p in item.summary],
            "content": [{"type": "reasoning_text", "text": p.text} for p in item.content or []] or None}


def _texts(content: str | list[InputTextPart]) -> list[str]:
    return [content] if isinstance(content, str) else [part.text for part in content]


def _part(kind: str, text: str) -> dict[str, Any]:
    return {"type": kind, "text": text, **({"annotations": []} if kind == "output_text" else {})}


def _fresh(kind: str) -> str:
    return f"{_PREFIX[kind]}_{secrets.token_hex(16)}"


def item_page(items: list[dict[str, Any]], limit: int = DEFAULT_LIMIT, order: Literal["asc", "desc"] = "desc",
              after: str | None = None) -> dict[str, Any]:
    """One page of ``items`` (kept oldest first) as OpenAI's list object: at most ``limit`` (1 to
    `MAX_LIMIT`, the route checks) items; ``order`` "desc" lists the newest first; ``after``: the
    id of the item the previous page ended with (400 when no item has it)."""
    listed = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in listed]
        if after not in ids:
            raise invalid_request(f"No input item with id '{after}' in this response.", "after")
        start = ids.index(after) + 1
    data = listed[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(listed)}
