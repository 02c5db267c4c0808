"""StopChecker: decides when one request's generation is finished, and what text is visible.

Two checks, in the order an engine step needs them (torch-free, so the router can run them too):

1. ``check_tokens(new_ids)`` on the ids a step produced (one, or several with speculative decoding).
   A stop token id, or an eos id unless ``ignore_eos``, finishes with "stop": that token counts as
   generated but is not visible text, and ids after it are dropped. Reaching ``max_tokens`` finishes
   with "length" and drops the ids beyond it. A stop/eos token that is also the last allowed token
   reports "stop" (the model ended by itself). The caller detokenizes only ``num_visible`` ids.
2. ``check_text(text)`` on the whole visible text so far. The first stop string to be *completed*
   (smallest end offset; on a tie the longer, earlier-starting one) finishes with "stop", overriding
   a token-based finish, and the text is cut before it. This result does not depend on how the text
   was split into tokens or steps. Only new text plus the last ``len(stop) - 1`` characters already
   seen are searched. Until finished, a suffix that could still grow into a stop string is held
   back from streaming.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from glmserve.core.generation import SamplingParams

TokenFinish = Literal["stop", "length"]  # what tokens alone can end with


@dataclass(frozen=True)
class TokenCheck:
    """``num_kept``: leading new ids that are part of the output (counted as generated);
    ``num_visible``: leading new ids to detokenize (``num_kept`` minus a final stop/eos token);
    ``stop_token_id``: the stop or eos id that finished the request, if one did."""

    num_kept: int
    num_visible: int
    finish_reason: TokenFinish | None
    stop_token_id: int | None = None


@dataclass(frozen=True)
class TextCheck:
    """``text[:text_end]`` is the visible output; ``text[:stream_end]`` may be sent to the client
    now (``stream_end <= text_end``; it never decreases between calls); ``stop_string``: the stop
    string that finished the request, if one did."""

    finish_reason: Literal["stop"] | None
    text_end: int
    stream_end: int
    stop_string: str | None = None


class StopChecker:
    """Per-request stop state. ``finish_reason`` / ``stop_reason`` hold the combined verdict
    (``stop_reason``: the stop token id or stop string, None for eos and length, as in vLLM)."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = ()) -> None:
        self.params = params
        # Ids that end generation; eos only counts when the request does not ignore it.
        self._stop_ids = frozenset(params.stop_token_ids)
        self._eos_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_tokens = 0
        self.finish_reason: TokenFinish | None = None
        self.stop_reason: int | str | None = None
        self._searched = 0  # characters of text already searched for stop strings
        self._text_result: TextCheck | None = None  # set once a stop string matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def check_tokens(self, new_token_ids: Sequence[int]) -> TokenCheck:
        """Account for the ids one step produced; see the module docstring."""
        if self.finished:
            raise RuntimeError(f"request already finished ({self.finish_reason}); no more tokens expected")
        room = self.params.max_tokens - self.num_tokens
        for i, token in enumerate(new_token_ids[:room]):
            if token in self._stop_ids or token in self._eos_ids:
                self.num_tokens += i + 1
                self.finish_reason = "stop"
                self.stop_reason = token if token in self._stop_ids else None
                return TokenCheck(i + 1, i, "stop", token)
        kept = min(len(new_token_ids), room)
        self.num_tokens += kept
        if self.num_tokens >= self.params.max_tokens:
            self.finish_reason = "length"
        return TokenCheck(kept, kept, self.finish_reason)

    def check_text(self, text: str) -> TextCheck:
        """Search the visible ``text`` so far (it only ever grows) for stop strings. Once the request
        is finished (by tokens or a stop string) nothing is held back."""
        if self._text_result is not None:
            return self._text_result
        if len(text) < self._searched:
            raise ValueError("text: the visible text only grows; it is shorter than what was already checked")
        match = self._first_stop(text)
        self._searched = len(text)
        if match is not None:
            start, stop = match
            self.finish_reason, self.stop_reason = "stop", stop
            self._text_result = TextCheck("stop", start, start, stop)
            return self._text_result
        held = 0 if self.finished else _partial_stop_len(text, self.params.stop)
        return TextCheck(None, len(text), len(text) - held)

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the earliest-completed stop string in the unsearched part."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.params.stop:
            # An occurrence must end in the new text; earlier ones were found by earlier calls.
            start = text.find(stop, max(0, self._searched - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                best = key if best is None or key < best else best
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    held = 0
    for stop in stops:
        # Candidate starts: the last len(stop) - 1 positions where the stop's first char occurs.
        first = stop[0]
        lo = max(0, len(text) - len(stop) + 1)
        at = text.find(first, lo)
        while 0 <= at and len(text) - at > held:
            if stop.startswith(text[at:]):
                held = len(text) - at  # the earliest start is the longest suffix for this stop
                break
            at = text.find(first, at + 1)
    return held
