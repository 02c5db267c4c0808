"""OpenAI request bodies in, validated into dataclasses (transport-free; responses are built in
`openai_responses`). Every rejection is an `APIError` (400 unless said otherwise), raised
before anything reaches a backend. Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from glmserve.core.generation import MAX_LOGPROBS, SamplingParams
from glmserve.services.router.errors import (
    context_length_exceeded,
    from_value_error,
    invalid_request,
    model_not_found,
)

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API allows 0..5
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_TOOL_CHOICES = ("none", "auto", "required")
_KINDS = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


@dataclass(frozen=True)
class GenerationOptions:
    """What chat and completions requests share. ``params.max_tokens`` is a placeholder until
    `sampling_params` knows the prompt length."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    params: SamplingParams

    def sampling_params(self, num_prompt: int, max_context: int, param: str) -> SamplingParams:
        """Final params; without ``max_tokens`` the completion may fill the rest of the context."""
        max_tokens = self.max_tokens if self.max_tokens is not None else max_context - num_prompt
        if max_tokens < 1 or num_prompt + max_tokens > max_context:
            raise context_length_exceeded(num_prompt, max(max_tokens, 1), max_context, param)
        return replace(self.params, max_tokens=max_tokens)


@dataclass(frozen=True)
class ChatRequest:
    options: GenerationOptions
    messages: list[dict[str, Any]]  # roles normalised, content flattened to text
    tools: list[dict[str, Any]] | None  # None: render and parse without tools (absent, or "none")


@dataclass(frozen=True)
class CompletionRequest:
    options: GenerationOptions
    prompt: str | list[int]


# --- parsing ------------------------------------------------------------------------------------


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid_request(f"The request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


def _field(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (bools are not numbers); None/absent -> ``default``."""
    value = body.get(name)
    if value is None:
        return default
    accepted = (int, float) if kind is float else kind  # JSON has one number type
    ok = isinstance(value, accepted) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and ok:
        ok = math.isfinite(value)
    if not ok:
        raise invalid_request(f"{name}: expected {_KINDS[kind]}, got {json.dumps(value)[:80]}", name)
    return value


def _options(body: dict[str, Any], logprobs: int | None) -> GenerationOptions:
    model = _field(body, "model", str)
    if not model:
        raise invalid_request("model: a model name is required", "model")
    stream = _field(body, "stream", bool, False)
    stream_options = _field(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise invalid_request("stream_options: only allowed when stream is true", "stream_options")
    include_usage = _field(stream_options or {}, "include_usage", bool, False)
    if _field(body, "n", int, 1) != 1:
        raise invalid_request("n: only n = 1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _field(body, name, float, 0.0) != 0.0:
            raise invalid_request(f"{name}: not supported (only 0)", name)
    if _field(body, "logit_bias", dict):
        raise invalid_request("logit_bias: not supported", "logit_bias")
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
        value = _field(body, name, int)
        if value is not None and value < 1:
            raise invalid_request(f"{name}: must be >= 1, got {value}", name)
        max_tokens = value if value is not None else max_tokens
    stop = body.get("stop")
    try:
        params = SamplingParams(
            max_tokens=max_tokens or 1,
            temperature=_field(body, "temperature", float, 1.0),
            top_p=_field(body, "top_p", float, 1.0),
            top_k=_field(body, "top_k", int, -1),
            seed=_field(body, "seed", int),
            stop=tuple(stop) if isinstance(stop, list) else (stop if stop is not None else ()),
            ignore_eos=_field(body, "ignore_eos", bool, False),  # vLLM extension, as is top_k
            logprobs=logprobs,
        )
    except ValueError as e:
        raise from_value_error(e) from e
    return GenerationOptions(model, stream, include_usage, max_tokens, params)


def _content_text(content: Any, where: str) -> str | None:
    """OpenAI content (a string, or text parts) as one string."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise invalid_request(f"{where}.content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid_request(f"{where}.content: expected a string or an array of text parts", "messages")


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid_request(f"{where}: expected an object", "messages")
    role = _ROLES.get(m.get("role")) if isinstance(m.get("role"), str) else None
    if role is None:
        raise invalid_request(
            f"{where}.role: must be one of {sorted(_ROLES)}, got {m.get('role')!r}", "messages"
        )
    out = {**m, "role": role, "content": _content_text(m.get("content"), where)}
    calls = m.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise invalid_request(f"{where}.tool_calls: only an array, on assistant messages", "messages")
    if out["content"] is None and not (role == "assistant" and calls):
        raise invalid_request(f"{where}.content: required for role {m['role']!r}", "messages")
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = _field(body, "tools", list)
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise invalid_request(
                f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}", "tools"
            )
        if not isinstance(fn.get("parameters", {}), dict):
            raise invalid_request(f"tools[{i}].function.parameters: expected an object", "tools")
        names.append(fn["name"])
    choice = body.get("tool_choice")
    if choice is None:
        return tools or None
    if isinstance(choice, dict):
        name = (
            (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        )
        if name not in names:
            raise invalid_request(
                f"tool_choice: names a function that is not in tools: {name!r}", "tool_choice"
            )
    elif choice not in _TOOL_CHOICES:
        raise invalid_request(
            f"tool_choice: must be one of {list(_TOOL_CHOICES)} or a named function", "tool_choice"
        )
    elif choice != "none" and not tools:
        raise invalid_request("tool_choice: only allowed when tools are given", "tool_choice")
    return None if choice == "none" else tools or None


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("messages: must be a non-empty array", "messages")
    logprobs = None
    if _field(body, "logprobs", bool, False):
        logprobs = _field(body, "top_logprobs", int, 0)
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise invalid_request(f"top_logprobs: must be in 0..{MAX_LOGPROBS}", "top_logprobs")
    elif _field(body, "top_logprobs", int) is not None:
        raise invalid_request("top_logprobs: needs logprobs = true", "top_logprobs")
    options = _options(body, logprobs)
    return ChatRequest(options, [_message(i, m) for i, m in enumerate(messages)], _tools(body))


def parse_completion_request(body: dict[str, Any], vocab_size: int) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or is_ids) or not prompt:
        raise invalid_request(
            "prompt: expected a non-empty string or array of token ids (one prompt)", "prompt"
        )
    if is_ids and not all(0 <= t < vocab_size for t in prompt):
        raise invalid_request(f"prompt: token ids must be in 0..{vocab_size - 1}", "prompt")
    if _field(body, "best_of", int, 1) != 1:
        raise invalid_request("best_of: only 1 is supported", "best_of")
    if _field(body, "echo", bool, False) or _field(body, "suffix", str):
        raise invalid_request("echo and suffix are not supported", "echo")
    logprobs = _field(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid_request(f"logprobs: must be in 0..{MAX_COMPLETION_LOGPROBS}", "logprobs")
    return CompletionRequest(_options(body, logprobs), prompt)


def check_model(options: GenerationOptions, served: str) -> None:
    """404 unless the request names the served model."""
    if options.model != served:
        raise model_not_found(options.model)
