"""OutputText: one request's output text, made once, where the engine runs.

Ids in (only the visible ones: a final eos / stop token is not text), text deltas out. Bytes are
decoded incrementally (a character split over tokens waits for its last byte); special tokens are
hidden except the request's ``visible_special_tokens``. With stop strings, the `StopChecker` finds
the first one completed: the text ends before it and the request finishes with "stop" in the same
step (no extra tokens, no abort round trip); until finished, a tail that could still grow into a
stop string is held back. At the finish everything that is text is flushed. A resumed request (`SamplingParams.num_resumed`)
starts with `resume`: the text of what an earlier attempt already streamed is made again, not
handed out, so a stop string or a character across the seam comes out as in one run.

Cost per push: the new ids' bytes, plus, with stop strings, a search of the new text and the
last ``len(stop) - 1`` characters (never the whole text again).
"""

from __future__ import annotations

from collections.abc import Sequence

from glmserve.core.generation import SamplingParams
from glmserve.core.stop_checker import StopChecker
from glmserve.text.detokenizer import IncrementalDetokenizer
from glmserve.text.tokenizer import Tokenizer


class OutputText:
    """``checker``: the request's stop checker (its token verdict decides when to flush)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, checker: StopChecker) -> None:
        visible = frozenset(
            i for i in (tokenizer.token_to_id(t) for t in params.visible_special_tokens) if i is not None
        )
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True,
                                                   visible_special_ids=visible)
        self._checker = checker
        self._has_stops = bool(params.stop)
        self.text = ""  # the visible output so far (cut before a stop string)
        self._streamed = 0  # characters of `text` already handed out

    def resume(self, ids: Sequence[int]) -> None:
        """Ids an earlier attempt produced and streamed: their text is made, and counted as
        streamed (what it held back then is held back now: it was never sent)."""
        self.text += self._detokenizer.push(ids)
        end = len(self.text)
        if self._has_stops:  # no stop string is in it (that attempt would have ended)
            end = self._checker.check_text(self.text).stream_end
        self._streamed = end

    def push(self, visible_ids: Sequence[int]) -> str:
        """Text newly safe to stream after these ids (call after the checker saw the tokens)."""
        self.text += self._detokenizer.push(visible_ids)
        if self._checker.finished:
            self.text += self._detokenizer.finish()
        end = len(self.text)
        if self._has_stops:
            result = self._checker.check_text(self.text)
            if result.text_end < len(self.text):
                self.text = self.text[: result.text_end]
            end = result.stream_end
        delta = self.text[self._streamed : end]
        self._streamed = max(self._streamed, end)
        return delta
