"""Incremental detokenization: ids in, text deltas out, never a broken UTF-8 character.

Byte-level tokens can split a character (an emoji is often 2-4 tokens). We keep the bytes of every
token and let Python's incremental UTF-8 decoder hold an incomplete tail until it completes, which
is exact and O(1) per token, unlike re-decoding a window of ids and diffing strings.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from glmserve.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Feed the growing id list with `update(ids)` (or new ids with `push`); `finish()` at the end.
    ``skip_special_tokens`` hides special tokens except those in ``visible_special_ids``."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False,
                 visible_special_ids: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._visible = visible_special_ids
        # errors="replace": bytes that can never form a character become U+FFFD, like decode() does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._consumed = 0
        self.text = ""  # everything emitted so far

    def push(self, new_ids: Sequence[int]) -> str:
        skip, visible, token_bytes = self._skip_special, self._visible, self._tokenizer.token_bytes
        data = b"".join(token_bytes(i, skip and i not in visible) for i in new_ids)
        self._consumed += len(new_ids)
        delta = self._utf8.decode(data)
        self.text += delta
        return delta

    def update(self, ids: Sequence[int]) -> str:
        """Text for `ids[already seen:]`; `ids` is the whole generation so far."""
        if len(ids) < self._consumed:
            raise ValueError("ids: the id list only grows; it is shorter than what was already consumed")
        return self.push(ids[self._consumed :])

    def finish(self) -> str:
        """Flush: a dangling incomplete character becomes U+FFFD."""
        delta = self._utf8.decode(b"", final=True)
        self.text += delta
        return delta
