"""ChatOutput: how one chat request's generated text is read, whole or streamed: first the
reasoning (`text/reasoning_parser.py`, when the request separates it), then, in what is left,
the tool calls (`CallParsing`). The one-shot parse is the stream fed once, so a streamed answer's
deltas always add up to the whole answer.

``start`` is where the output begins (`reasoning_start` of the prompt); ``separate``: the reasoning
goes into ``reasoning_content`` (else it stays in the content, tags and all). The grammar's
reasoning mode follows from both (`grammar_reasoning`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glmserve.core.grammar_spec import ReasoningMode
from glmserve.services.router.tool_call_parsing import CallParsing
from glmserve.text.reasoning_parser import ReasoningParser, ReasoningStart

# ``--reasoning-parser``: "glm45" separates `<think>` blocks by default (a request's
# ``separate_reasoning`` decides for itself); "none" leaves them in the content by default.
REASONING_PARSERS = ("glm45", "none")


def grammar_reasoning(start: ReasoningStart, separate: bool) -> ReasoningMode:
    """Where a grammar begins: after `</think>` when the prompt opened the block (the model must
    close it first), after an optional leading block when the output may open one and it is
    separated, else at the first token."""
    if start == "open":
        return "enabled"
    return "auto" if start == "none" and separate else "disabled"


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: ChatDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


class ChatStream:
    """`feed(text)` per delta, `finish()` once; each returns what became final."""

    def __init__(self, output: ChatOutput) -> None:
        self._calls = output.calls
        self._reasoning = ReasoningParser(output.start) if output.separate else None
        self._tools = output.calls.stream_parser()

    def feed(self, text: str) -> ChatDelta:
        return self._step(text, finish=False)

    def finish(self) -> ChatDelta:
        return self._step("", finish=True)

    def _step(self, text: str, finish: bool) -> ChatDelta:
        out = ChatDelta()
        if self._reasoning is not None:
            parts = [self._reasoning.feed(text)] + ([self._reasoning.finish()] if finish else [])
            out.reasoning = "".join(p.reasoning for p in parts)
            text = "".join(p.content for p in parts)
        if self._tools is None:
            out.content = text
            return out
        parts = [self._tools.feed(text)] + ([self._tools.finish()] if finish else [])
        out.content = "".join(p.content for p in parts)
        out.tool_calls = self._calls.allowed([c for p in parts for c in p.tool_calls])
        return out


@dataclass(frozen=True)
class ChatOutput:
    calls: CallParsing
    start: ReasoningStart = "none"
    separate: bool = False

    def stream(self) -> ChatStream:
        return ChatStream(self)

    def parse(self, text: str) -> ChatDelta:
        """The whole answer: reasoning, content and the calls (merged from their stream deltas)."""
        stream = self.stream()
        out = stream.feed(text)
        out.add(stream.finish())
        out.tool_calls = self.calls.whole(out.tool_calls)
        return out
