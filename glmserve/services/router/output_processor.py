"""OutputProcessor: one request's token ids in, the text a client may see out.

Why the router detokenizes (and not the engine): the tool-call markers (`<tool_call>`, `<arg_key>`,
...) are special tokens. Text meant for the tool-call parser must keep them, while every other
special token (eos, role markers, `<think>`) is hidden, as `skip_special_tokens=True` would do.

Per event it: drops a final eos / stop token, decodes bytes incrementally (never a split UTF-8
character), cuts the text before the first stop string and holds back a tail that could still
become one (using the engine's own `StopChecker`, so both sides agree on where text ends).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.core.stop_checker import StopChecker
from glmserve.text.special_tokens import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
)
from glmserve.text.tokenizer import Tokenizer

TOOL_MARKUP = (TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START, ARG_KEY_END, ARG_VALUE_START, ARG_VALUE_END)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    bytes: bytes
    logprob: float


@dataclass
class TextDelta:
    """What one event added: visible text, and the logprobs of the tokens that made it."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)


class OutputProcessor:
    """Feed every `TokenEvent` of one request to `push`, in order."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, keep_tool_markup: bool = False):
        self._tokenizer = tokenizer
        self._params = params
        keep = TOOL_MARKUP if keep_tool_markup else ()
        self._keep_ids = frozenset(i for i in (tokenizer.token_to_id(t) for t in keep) if i is not None)
        self._end_ids = frozenset(tokenizer.eos_token_ids) | frozenset(params.stop_token_ids)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = StopChecker(params) if params.stop else None
        self._text = ""  # visible text so far, already cut at a stop string
        self._streamed = 0  # characters of `_text` handed out
        self.num_generated = 0  # ids the backend generated (usage counts these)
        self.num_cached_tokens = 0
        self.stopped_by_text = False  # a stop string matched: the caller must end the request

    @property
    def text(self) -> str:
        return self._text

    def push(self, event: TokenEvent) -> TextDelta:
        """Text (and logprobs) newly safe to send; with ``event.finished`` everything is flushed."""
        self.num_generated += len(event.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        if self.stopped_by_text:
            return TextDelta()
        ids = list(event.token_ids)
        if event.finished and event.finish_reason == "stop" and ids and ids[-1] in self._end_ids:
            ids.pop()  # the eos / stop token ends the output; it is not text
        raw = [self._token_bytes(i) for i in ids]
        self._text += self._utf8.decode(b"".join(raw), final=event.finished)
        end = len(self._text)
        if self._stop is not None:
            check = self._stop.check_text(self._text)
            self._text = self._text[: check.text_end]
            self.stopped_by_text = check.finish_reason is not None
            end = check.text_end if event.finished else check.stream_end
        delta = self._text[self._streamed : max(end, self._streamed)]
        self._streamed = max(end, self._streamed)
        return TextDelta(delta, self._logprobs(ids, raw, event.logprobs))

    def flush(self) -> str:
        """Whatever was held back; for a stream that ended without a final event (stopped by text)."""
        if not self.stopped_by_text:  # bytes after a stop string are not text
            self._text += self._utf8.decode(b"", final=True)
        delta = self._text[self._streamed :]
        self._streamed = len(self._text)
        return delta

    def _token_bytes(self, token_id: int) -> bytes:
        return self._tokenizer.token_bytes(token_id, skip_special_tokens=token_id not in self._keep_ids)

    def _logprobs(self, ids: list[int], raw: list[bytes], logprobs: list[float]) -> list[TokenLogprob]:
        if self._params.logprobs is None:
            return []
        return [
            TokenLogprob(i, b.decode("utf-8", errors="replace"), b, lp)
            for i, b, lp in zip(ids, raw, logprobs, strict=False)
        ]
