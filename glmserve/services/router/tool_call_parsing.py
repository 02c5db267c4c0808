"""CallParsing: how one chat request's output is read for tool calls.

- ``tools``: the tools offered (None: no parsing, the text is the content);
- ``strip_values``: whitespace around argument values is formatting, not content. Set when a
  grammar forced the calls: xgrammar's GLM grammar allows one whitespace around a value, which
  must not become part of a string (an enum value, a maxLength). Free calls keep values as written;
- ``parallel``: OpenAI ``parallel_tool_calls``; when false, only the first call is returned (a
  forced call's grammar allows one call only; a free one may still write more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glmserve.text.tool_calls import ParsedOutput, ToolCallStreamParser, merge_call_deltas, parse_tool_calls


@dataclass(frozen=True)
class CallParsing:
    tools: list[dict[str, Any]] | None
    strip_values: bool = False
    parallel: bool = True

    def parse(self, text: str) -> ParsedOutput:
        if not self.tools:
            return ParsedOutput(text)
        parsed = parse_tool_calls(text, self.tools, strip_values=self.strip_values)
        return ParsedOutput(parsed.content, self.allowed(parsed.tool_calls))

    def stream_parser(self) -> ToolCallStreamParser | None:
        return ToolCallStreamParser(self.tools, strip_values=self.strip_values) if self.tools else None

    def whole(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Streamed call deltas (with ``index``) merged into the whole calls, as a message has them."""
        return merge_call_deltas(deltas)

    def allowed(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The calls to return (streamed calls carry their ``index``; whole ones are in order)."""
        if self.parallel:
            return calls
        if calls and "index" in calls[0]:
            return [c for c in calls if c["index"] == 0]
        return calls[:1]
