"""Split GLM output into reasoning (`<think>` ... `</think>`) and content, whole or streamed.

Where the output starts is read from the prompt (`reasoning_start`): the chat template may have
rendered this turn's think block already.

- "open": the prompt ends inside an open `<think>` (the template forced thinking): the output is
  reasoning up to `</think>`, then content. No `</think>` at all: all of it is reasoning.
- "closed": the prompt closed this turn's block (`<think></think>`, thinking turned off): all of the
  output is content.
- "none": the template rendered neither: the output is reasoning only if it opens with `<think>`
  (after optional whitespace), else all content.

Rules shared by the streaming and the one-shot parser (the one-shot parser is the streaming one fed
a single delta, so both agree):

- Whitespace around the reasoning and between `</think>` and the content is dropped (GLM's template
  writes `<think>{reasoning}</think>\\n{content}`).
- A tail that could still become a tag (a partial `<think>` or `</think>` spelled in ordinary
  tokens) is held back until it cannot, and flushed by `finish()`.
- Once content has started, everything is content (a later `<think>` is text like any other).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from glmserve.text.special_tokens import ASSISTANT, THINK_END, THINK_START, partial_tag_len
from glmserve.text.tokenizer import Tokenizer

ReasoningStart = Literal["none", "open", "closed"]


def reasoning_start(prompt_ids: Sequence[int], tokenizer: Tokenizer) -> ReasoningStart:
    """Whether the prompt's last assistant turn opened (and closed) a think block."""
    ids = {name: tokenizer.token_to_id(name) for name in (ASSISTANT, THINK_START, THINK_END)}
    opened = closed = -1
    for i in range(len(prompt_ids) - 1, -1, -1):
        t = prompt_ids[i]
        if t == ids[ASSISTANT]:
            break
        if t == ids[THINK_START] and opened < 0:
            opened = i
        elif t == ids[THINK_END] and closed < 0:
            closed = i
    if opened >= 0 and closed < opened:
        return "open"
    return "closed" if closed >= 0 else "none"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Incremental: `feed(delta)` per text delta, then `finish()` once at the end."""

    def __init__(self, start: ReasoningStart = "none") -> None:
        # "before": a <think> may still open; "reasoning"; "content" (everything passes)
        self._state = {"none": "before", "open": "reasoning", "closed": "content"}[start]
        self._buf = ""  # text not yet classified
        self._ws = ""  # reasoning's trailing whitespace, dropped if `</think>` follows
        self._started = False  # some reasoning text was emitted (leading whitespace is dropped)
        self._out = ReasoningDelta()

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        self._advance()
        return self._take()

    def finish(self) -> ReasoningDelta:
        if self._state == "reasoning":
            self._reason(self._buf)  # an unclosed block: its (partial-tag) tail is reasoning too
        else:  # "before": whitespace or a partial tag that never opened a block is content
            self._out.content += self._buf
        self._buf = ""
        return self._take()

    def _take(self) -> ReasoningDelta:
        out, self._out = self._out, ReasoningDelta()
        return out

    def _advance(self) -> None:
        while True:
            if self._state == "before":
                rest = self._buf.lstrip()
                if rest.startswith(THINK_START):
                    self._buf, self._state = rest[len(THINK_START) :], "reasoning"
                    continue
                if rest == "" or THINK_START.startswith(rest):
                    return  # whitespace, or a partial tag: wait
                self._state = "content"
            if self._state == "reasoning":
                i = self._buf.find(THINK_END)
                if i < 0:
                    keep = partial_tag_len(self._buf, THINK_END)
                    self._reason(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._reason(self._buf[:i])
                self._buf, self._ws, self._state = self._buf[i + len(THINK_END) :], "", "after"
            if self._state == "after":  # whitespace after `</think>` is dropped
                rest = self._buf.lstrip()
                if not rest:
                    self._buf = ""
                    return
                self._buf, self._state = rest, "content"
            self._out.content += self._buf
            self._buf = ""
            return

    def _reason(self, text: str) -> None:
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            self._out.reasoning += self._ws + body
            self._ws, self._started = "", True
        self._ws += text[len(body) :]


def parse_reasoning(text: str, start: ReasoningStart = "none") -> ReasoningDelta:
    """One-shot split of a finished generation."""
    parser = ReasoningParser(start)
    first, last = parser.feed(text), parser.finish()
    return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)
