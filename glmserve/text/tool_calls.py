"""Parse GLM tool calls out of generated text, whole or streamed, into OpenAI `tool_calls`.

Format: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`, with optional
whitespace between the parts. Rules, shared by the streaming and the one-shot parser (the one-shot
parser is the streaming one fed a single delta, so both always agree):

- A call streams in pieces, as vLLM streams them: its first delta carries the index, id and name,
  then the arguments JSON follows piece by piece (`{"k": v`, `, "k2": "...`), and `</tool_call>`
  adds the closing `}` (or `{}`). A value the tool's schema types as a string streams as its
  characters arrive (JSON-escaped); any other value once its `</arg_value>` is in (its type is read
  from the whole text). The pieces always add up to ``json.dumps(arguments)``.
- A call commits (its first delta goes out) only once its name is followed by a complete,
  well-formed pair or by `</tool_call>`; before that, anything malformed (no name, a name with a
  space, a stray tag, a value without tags, a new `<tool_call>`) makes the whole block content,
  character for character, up to its `</tool_call>` (or the new `<tool_call>`, or the end).
- A committed call cannot be taken back: if its body breaks later (a malformed or repeated pair, a
  new `<tool_call>`) or the output ends first, the call ends there with the pairs it has, and the
  text from the break on is read again as output (content, or a new call); nothing is lost. A
  streaming string value ends at `</arg_value>`, or with its call at `</tool_call>` or a new
  `<tool_call>` (then the next call), or at the end of the output, and keeps what it had.
- Text is never streamed as content while it could still turn out to be part of a call: a
  trailing partial `<tool_call` is held back while it could still become the tag, and flushed as
  content by `finish()` if it never does.
- Whitespace that only separates calls from content or from each other is dropped.
- Values: parsed as JSON (number, bool, null, object, array) unless the tool's schema says the
  parameter is a string or the value is not JSON; otherwise the raw string. A value cannot contain
  the literal `</arg_value>`, `<tool_call>` or `</tool_call>`.
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

from glmserve.text.special_tokens import TOOL_CALL_END, TOOL_CALL_START, partial_tag_len
from glmserve.text.tool_call_values import coerce_value, is_string_param, tool_properties

_NAME = re.compile(r"\s*([^\s<>]+)\s*")

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
    """What one `feed` produced: a content delta and call deltas in OpenAI streaming shape (at most
    one per call, each with its ``index``)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


_KEY_START, _KEY_END = "<arg_key>", "</arg_key>"
_VALUE_START, _VALUE_END = "<arg_value>", "</arg_value>"
_WAIT, _BROKEN = "wait", "broken"  # what `_pair` says besides a complete pair
_VALUE_ENDS = (_VALUE_END, TOOL_CALL_END, TOOL_CALL_START)  # what ends a streaming string value


def _could_become(text: str, *tags: str) -> bool:
    """``text`` is a proper prefix of one of ``tags`` (the rest may still arrive)."""
    return any(len(text) < len(t) and t.startswith(text) for t in tags)


class ToolCallStreamParser:
    """Incremental parser: `feed(delta)` per text delta, then `finish()` once at the end."""

    def __init__(self, tools: list[dict[str, Any]] | None = None, call_id: CallIdFactory = random_call_id,
                 strip_values: bool = False):
        self._props = tool_properties(tools)
        self._strip = strip_values
        self._call_id = call_id
        self._buf = ""  # text not yet classified: a held `<tool_call` prefix, or an open call
        self._inside = False  # `_buf` starts with `<tool_call>`
        self._name: str | None = None  # inside: the open call's name, once it streams (committed)
        self._pos = 0  # committed: where the next pair starts in `_buf`
        self._keys: set[str] = set()  # committed: the argument keys so far
        self._value = False  # committed: a string value is streaming (from `_pos`)
        self._sent = 0  # ... and this many of its characters went out
        self._scanned = 0  # inside, not committed, broken: no tag ends before this offset of `_buf`
        self._broken = False  # inside, not committed: the block is not a call (it stays content)
        self._ws = ""  # trailing whitespace of content, dropped if a valid call follows
        self._after_call = False  # nothing but whitespace since the last valid call
        self._index = 0
        self._out = StreamDelta()

    def feed(self, text: str) -> StreamDelta:
        self._buf += text
        self._advance()
        return self._take()

    def finish(self) -> StreamDelta:
        if self._name is not None:
            rest = self._buf[self._pos :]
            if self._value:  # a string value cut short keeps what arrived
                self._end_value(rest)
                rest = ""
            self._close()  # a call cut short keeps its complete arguments; the partial pair is text
            self._buf = rest
        self._emit_text(self._buf)  # an uncommitted call or a partial tag is plain content
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
        while True:
            if not self._inside:
                i = self._buf.find(TOOL_CALL_START)
                if i < 0:
                    keep = partial_tag_len(self._buf, TOOL_CALL_START)
                    self._emit_text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._emit_text(self._buf[:i])
                self._buf, self._inside, self._broken = self._buf[i:], True, False
                self._scanned = len(TOOL_CALL_START)
            elif self._broken:
                if not self._skip_broken():
                    return
            elif self._name is None:
                if not self._open():
                    return
            elif not (self._next_value() if self._value else self._next_pair()):
                return

    def _skip_broken(self) -> bool:
        """A block that is not a call is content up to its `</tool_call>` or a new `<tool_call>`."""
        j_end = self._buf.find(TOOL_CALL_END, self._scanned)
        j_new = self._buf.find(TOOL_CALL_START, self._scanned)
        if 0 <= j_new and (j_end < 0 or j_new < j_end):
            self._emit_text(self._buf[:j_new])
            self._buf, self._broken, self._scanned = self._buf[j_new:], False, len(TOOL_CALL_START)
            return True
        if j_end < 0:
            self._scanned = max(self._scanned, len(self._buf) - len(TOOL_CALL_END) + 1)  # the longer tag
            return False
        self._emit_text(self._buf[: j_end + len(TOOL_CALL_END)])
        self._buf, self._inside, self._broken = self._buf[j_end + len(TOOL_CALL_END) :], False, False
        return True

    def _open(self) -> bool:
        """Before the call streams: its name, then the first complete pair or the close commits it."""
        m = _NAME.match(self._buf, len(TOOL_CALL_START))
        if m is None:
            if self._buf[len(TOOL_CALL_START) :].strip() == "":
                return False  # nothing but whitespace yet
            self._broken = True  # no name
            return True
        pos = m.end()
        rest = self._buf[pos:]
        if not rest:
            return False  # the name (or the whitespace after it) may go on
        if rest.startswith(TOOL_CALL_END):
            self._commit(m.group(1), pos)
            return True
        if _could_become(rest, TOOL_CALL_END, _KEY_START):
            return False
        if not rest.startswith(_KEY_START):
            self._broken = True
            return True
        pair = self._pair(pos, None)
        if pair == _WAIT:
            return False
        if pair == _BROKEN:
            self._broken = True
            return True
        self._commit(m.group(1), pos)
        return True

    def _commit(self, name: str, pos: int) -> None:
        self._ws, self._after_call = "", True  # whitespace before a call is not content
        self._name, self._pos, self._keys = name, pos, set()
        self._out.tool_calls.append({"index": self._index, "id": self._call_id(self._index), "type": "function",
                                     "function": {"name": name, "arguments": ""}})

    def _next_pair(self) -> bool:
        """Committed: stream the next complete pair, close at `</tool_call>`; a break ends the call
        with what it has, and the text from the break on is read again as output."""
        rest = self._buf[self._pos :].lstrip()
        at = len(self._buf) - len(rest)
        if rest.startswith(TOOL_CALL_END):
            self._close()
            self._buf = self._buf[at + len(TOOL_CALL_END) :]
            return True
        if not rest or _could_become(rest, TOOL_CALL_END, _KEY_START):
            return False
        pair = self._pair(at, self._props.get(self._name, {})) if rest.startswith(_KEY_START) else _BROKEN
        if pair == _WAIT:
            return False
        if pair == _BROKEN or pair[0] in self._keys:
            self._close()
            self._buf = self._buf[at:]
            return True
        key = pair[0]
        self._keys.add(key)
        start = ("{" if len(self._keys) == 1 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        if len(pair) == 2:  # a string value: it streams as it arrives
            self._arguments(start + '"')
            self._pos, self._value, self._sent = pair[1], True, 0
            return True
        _, value, end = pair
        schema = self._props.get(self._name, {}).get(key)
        self._arguments(start + json.dumps(coerce_value(value, schema), ensure_ascii=False))
        self._pos = end
        return True

    def _next_value(self) -> bool:
        """A string value streams up to `</arg_value>`; `</tool_call>` or a new `<tool_call>` in it
        ends the value and the call there (the one-shot parse reads it the same way)."""
        body = self._buf[self._pos :]
        ends = [(i, tag) for tag in _VALUE_ENDS if (i := body.find(tag)) >= 0]
        if not ends:
            held = max(partial_tag_len(body, tag) for tag in _VALUE_ENDS)
            self._send(body[: len(body) - held], final=False)
            return False
        i, tag = min(ends)
        self._end_value(body[:i])
        if tag == _VALUE_END:
            self._pos += i + len(tag)
            return True
        rest = self._buf[self._pos + i + (len(tag) if tag == TOOL_CALL_END else 0) :]
        self._close()
        self._buf = rest
        return True

    def _send(self, raw: str, final: bool) -> None:
        """The value's characters that are final now, JSON-escaped (escaping is per character, so
        the pieces add up to the escaped whole); with ``strip_values`` whitespace at either end is
        held until it is known not to be the end."""
        text = (raw.strip() if final else raw.lstrip().rstrip()) if self._strip else raw
        if len(text) > self._sent:
            self._arguments(json.dumps(text[self._sent :], ensure_ascii=False)[1:-1])
            self._sent = len(text)

    def _end_value(self, raw: str) -> None:
        self._send(raw, final=True)
        self._arguments('"')
        self._value = False

    def _pair(self, at: int, props: dict[str, Any] | None) -> tuple[str, str, int] | tuple[str, int] | str:
        """The `<arg_key>K</arg_key><arg_value>V</arg_value>` at ``at``: (key, value, end), or
        `_WAIT` (it may still complete), or `_BROKEN`. In a committed call (``props``: its
        parameters) a string parameter's pair is (key, value start) as soon as `<arg_value>` is in."""
        buf = self._buf
        k = at + len(_KEY_START)
        k_end = buf.find(_KEY_END, k)
        if k_end < 0:
            tail = buf[k:]
            return _WAIT if "<" not in tail[: len(tail) - partial_tag_len(tail, _KEY_END)] else _BROKEN
        key = buf[k:k_end]
        if "<" in key or not key.strip():
            return _BROKEN
        v = k_end + len(_KEY_END)
        between = buf[v:]
        gap = between.lstrip()
        v += len(between) - len(gap)
        if not gap or _could_become(gap, _VALUE_START):
            return _WAIT
        if not gap.startswith(_VALUE_START):
            return _BROKEN
        v += len(_VALUE_START)
        if props is not None and is_string_param(props.get(key.strip())):
            return key.strip(), v
        v_end = buf.find(_VALUE_END, v)
        body = buf[v:] if v_end < 0 else buf[v:v_end]
        if TOOL_CALL_START in body or TOOL_CALL_END in body:
            return _BROKEN
        if v_end < 0:
            return _WAIT
        value = body.strip() if self._strip else body
        return key.strip(), value, v_end + len(_VALUE_END)

    def _arguments(self, piece: str) -> None:
        last = self._out.tool_calls[-1] if self._out.tool_calls else None
        if last is not None and last["index"] == self._index:
            last["function"]["arguments"] += piece
        else:
            self._out.tool_calls.append({"index": self._index, "function": {"arguments": piece}})

    def _close(self) -> None:
        self._arguments("}" if self._keys else "{}")
        self._index += 1
        self._name, self._inside, self._pos, self._value = None, False, 0, False
        self._ws, self._after_call = "", True


def merge_call_deltas(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed call deltas (OpenAI shape, each with ``index``) merged into whole calls, in index
    order, without ``index``: the first delta of a call has its id, type and name, and every
    delta's ``function.arguments`` is the next piece of the arguments."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if d.get("id"):
            call["id"] = d["id"]
        fn = d.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def parse_tool_calls(
    text: str, tools: list[dict[str, Any]] | None = None, call_id: CallIdFactory = random_call_id,
    strip_values: bool = False,
) -> ParsedOutput:
    """One-shot parse of a finished generation into content and OpenAI `tool_calls`."""
    parser = ToolCallStreamParser(tools, call_id, strip_values)
    first, last = parser.feed(text), parser.finish()
    return ParsedOutput(first.content + last.content, merge_call_deltas(first.tool_calls + last.tool_calls))
