"""Render OpenAI-format chats with the GLM chat template (jinja2 sandbox, like transformers)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from glmserve.text.chat_template import CHAT_TEMPLATE

_ROLES = frozenset({"system", "user", "assistant", "tool"})


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same as transformers' override: jinja's own tojson HTML-escapes `<`, `>` and `&`,
    # which would make our rendering differ from AutoTokenizer.apply_chat_template.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in an environment configured like transformers' (whitespace options,
    filters, globals), so both render byte-identical text. Templates are untrusted: sandboxed."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def _normalize_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends `arguments` as a JSON string; the template needs a mapping to write key/value pairs."""
    fn = dict(call.get("function") or call)
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError("messages: tool_calls[].function.name must be a non-empty string")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ValueError(f"messages: tool_calls[].function.arguments is not valid JSON: {e}") from e
    if not isinstance(args, dict):
        raise ValueError("messages: tool_calls[].function.arguments must be a JSON object")
    fn["arguments"] = args
    return {**call, "type": call.get("type", "function"), "function": fn}


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate roles and turn string tool-call arguments into dicts; the input is not modified."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {sorted(_ROLES)}")
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [_normalize_tool_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "raise_exception"})


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    template: str = CHAT_TEMPLATE,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render a chat to the prompt text; ``template_kwargs`` (OpenAI-compatible servers'
    ``chat_template_kwargs``, e.g. ``enable_thinking``) become template variables. Raises
    ValueError on malformed messages or tools, or a kwarg naming a variable the renderer sets."""
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of objects")
    reserved = sorted(RESERVED_TEMPLATE_NAMES & set(template_kwargs or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs: {reserved[0]!r} is set by the server")
    try:
        return compile_chat_template(template).render(
            **(template_kwargs or {}),
            messages=normalize_messages(messages),
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template: {e}") from e
