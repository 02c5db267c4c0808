"""OpenAI response bodies and SSE stream chunks (chat and legacy completions), transport-free.

Shapes follow the OpenAI API so the unmodified `openai` client parses them; `sse` frames one chunk.
"""

from __future__ import annotations

import json
from typing import Any

from glmserve.services.router.chat_output import ChatDelta
from glmserve.services.router.errors import APIError
from glmserve.services.router.token_logprobs import TokenLogprob


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def chat_completion(
    rid: str,
    created: int,
    model: str,
    content: str | None,
    tool_calls: list[dict[str, Any]],
    finish_reason: str,
    usage_: dict[str, Any],
    logprobs: dict[str, Any] | None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_,
    }


def chat_delta(part: ChatDelta) -> dict[str, Any]:
    """A stream chunk's ``delta`` for a `ChatDelta` (reasoning, content, tool-call deltas)."""
    delta: dict[str, Any] = {}
    if part.reasoning:
        delta["reasoning_content"] = part.reasoning
    if part.content or not (part.reasoning or part.tool_calls):
        delta["content"] = part.content
    if part.tool_calls:
        delta["tool_calls"] = part.tool_calls
    return delta


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None,
    usage_: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole completion, or (``usage_`` None, ``finish_reason`` None mid-stream) one stream chunk."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: usage and no choices."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """Chat `logprobs`: per token its logprob and the request's `top_logprobs` alternatives."""
    content = [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.bytes),
            "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in e.top],
        }
        for e in entries
    ]
    return {"content": content}


def completion_logprobs(entries: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    """Legacy completions `logprobs`; ``text_offset`` is where the first entry's text starts. Per
    token, `top_logprobs` maps the `logprobs` most likely tokens, and always the chosen one, to
    their logprobs (so up to `logprobs` + 1 entries, as the OpenAI API documents)."""
    offsets, tops = [], []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
        top = {a.token: a.logprob for a in e.top}
        top.setdefault(e.token, e.logprob)
        tops.append(top)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def model_card(model: str, created: int, max_context: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "glmserve", "max_model_len": max_context}


def model_list(model: str, created: int, max_context: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, max_context)]}


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def named_sse(event: dict[str, Any]) -> str:
    """One SSE event named by its ``type`` (the Responses and Messages APIs' framing)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def error_event(err: APIError) -> str:
    return sse(err.to_dict())
