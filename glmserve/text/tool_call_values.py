"""The values of GLM tool-call arguments: each `<arg_value>` is written as-is for a string
parameter and as JSON otherwise (the chat template's rule), so its type is restored from the
tool's JSON schema when there is one, and from the text when there is not."""

from __future__ import annotations

import json
from typing import Any


def tool_properties(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Map tool name -> JSON-schema `properties` of its parameters (OpenAI or bare function format)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        if isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = props
    return out


def is_string_param(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    if t == "string" or (isinstance(t, list) and "string" in t):
        return True
    enum = schema.get("enum")
    return t is None and isinstance(enum, list) and bool(enum) and all(isinstance(e, str) for e in enum)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity would not survive json.dumps as valid JSON


def coerce_value(raw: str, schema: Any = None) -> Any:
    """The typed value of an `<arg_value>`: parsed JSON unless the schema wants a string."""
    if is_string_param(schema):
        return raw
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw
    return raw if isinstance(value, str) else value  # a quoted string stays as written
