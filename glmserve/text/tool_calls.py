"""Parse GLM tool calls out of generated text, whole or streamed, into OpenAI `tool_calls`.

Format: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, with optional
whitespace between the parts. Rules, shared by the streaming and the one-shot parser (the one-shot
parser is the streaming one fed a single delta, so both always agree):

- A call is reported only once its `</tool_call>` has arrived and the body is well formed; a name
  streamed early could not be taken back if the body then turned out malformed.
- Anything malformed (unclosed call, missing name, stray tags, a new `<tool_call>` before the
  previous one closed) stays content, character for character.
- Whitespace that only separates valid calls from content or from each other is dropped.
- A trailing partial `<tool_call` is held back while it could still become the tag, and flushed
  as content by `finish()` if it never does.
- Values: parsed as JSON (number, bool, null, object, array) unless the tool's schema says the
  parameter is a string or the value is not JSON; otherwise the raw string. A value cannot contain
  the literal `</arg_value>` or `</tool_call>`.
- ``strip_values``: whitespace around each value is dropped (as GLM's reference parsers in vLLM
  and SGLang do). The router sets it for calls a grammar constrained: xgrammar's GLM grammar allows
  a whitespace around a value as formatting, which must not become part of a string (an enum
  value, a maxLength). Free calls keep values exactly as written (the chat template writes them
  as-is, so a value's own leading or trailing whitespace survives a round trip).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from glmserve.text.special_tokens import TOOL_CALL_END, TOOL_CALL_START

_NAME = re.compile(r"\s*([^\s<>]+)\s*")
_ARG = re.compile(r"<arg_key>([^<]*)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)

CallIdFactory = Callable[[int], str]


def random_call_id(index: int) -> str:
    """OpenAI-style id; random so ids never collide across the turns of a session."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class StreamDelta:
    """What one `feed` produced: a content delta and finished calls in OpenAI streaming shape."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def tool_properties(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Map tool name -> JSON-schema `properties` of its parameters (OpenAI or bare function format)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        if isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = props
    return out


def _is_string_param(schema: Any) -> bool:
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
    if _is_string_param(schema):
        return raw
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw
    return raw if isinstance(value, str) else value  # a quoted string stays as written


def parse_call_body(
    body: str, properties: dict[str, dict[str, Any]], strip_values: bool = False
) -> tuple[str, dict[str, Any]] | None:
    """Name and arguments of the text between `<tool_call>` and `</tool_call>`; None if malformed."""
    m = _NAME.match(body)
    if m is None:
        return None
    name, pos, args = m.group(1), m.end(), {}
    schema = properties.get(name, {})
    while pos < len(body):
        a = _ARG.match(body, pos)
        if a is None:
            return None
        key = a.group(1).strip()
        if not key:
            return None
        value = a.group(2).strip() if strip_values else a.group(2)
        args[key] = coerce_value(value, schema.get(key))
        pos = a.end()
    return name, args


def _held_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallStreamParser:
    """Incremental parser: `feed(delta)` per text delta, then `finish()` once at the end."""

    def __init__(self, tools: list[dict[str, Any]] | None = None, call_id: CallIdFactory = random_call_id,
                 strip_values: bool = False):
        self._props = tool_properties(tools)
        self._strip = strip_values
        self._call_id = call_id
        self._buf = ""  # text not yet classified: a held `<tool_call` prefix, or an open call
        self._inside = False  # `_buf` starts with `<tool_call>`
        self._scanned = 0  # inside: tags cannot start before this offset of `_buf` (avoids rescans)
        self._ws = ""  # trailing whitespace of content, dropped if a valid call follows
        self._after_call = False  # nothing but whitespace since the last valid call
        self._index = 0
        self._out = StreamDelta()

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        self._advance()
        return self._take()

    def finish(self) -> StreamDelta:
        self._emit_text(self._buf)  # an unclosed call or a partial tag is plain content
        self._buf, self._inside = "", False
        if not self._after_call:
            self._out.content += self._ws
        self._ws = ""
        return self._take()

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

    def _emit_text(self, text: str) -> None:
        body = text.rstrip()
        if body:
            self._out.content += self._ws + body
            self._ws, self._after_call = "", False
        self._ws += text[len(body) :]

    def _advance(self) -> None:
        start, end = TOOL_CALL_START, TOOL_CALL_END
        while True:
            if not self._inside:
                i = self._buf.find(start)
                if i < 0:
                    keep = _held_prefix_len(self._buf, start)
                    self._emit_text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._emit_text(self._buf[:i])
                self._buf, self._inside, self._scanned = self._buf[i:], True, len(start)
                continue
            j_end = self._buf.find(end, self._scanned)
            j_new = self._buf.find(start, self._scanned)
            if 0 <= j_new and (j_end < 0 or j_new < j_end):
                # A new call opened before this one closed: this one was not a call.
                self._emit_text(self._buf[:j_new])
                self._buf, self._scanned = self._buf[j_new:], len(start)
                continue
            if j_end < 0:
                self._scanned = max(len(start), len(self._buf) - max(len(start), len(end)) + 1)
                return
            self._close_call(self._buf[: j_end + len(end)])
            self._buf, self._inside = self._buf[j_end + len(end) :], False

    def _close_call(self, block: str) -> None:
        parsed = parse_call_body(block[len(TOOL_CALL_START) : -len(TOOL_CALL_END)], self._props, self._strip)
        if parsed is None:
            self._emit_text(block)
            return
        name, args = parsed
        self._out.tool_calls.append(
            {
                "index": self._index,
                "id": self._call_id(self._index),
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
        self._index += 1
        self._ws, self._after_call = "", True


def parse_tool_calls(
    text: str, tools: list[dict[str, Any]] | None = None, call_id: CallIdFactory = random_call_id,
    strip_values: bool = False,
) -> ParsedOutput:
    """One-shot parse of a finished generation into content and OpenAI `tool_calls`."""
    parser = ToolCallStreamParser(tools, call_id, strip_values)
    first, last = parser.feed(text), parser.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in first.tool_calls + last.tool_calls]
    return ParsedOutput(content=first.content + last.content, tool_calls=calls)
