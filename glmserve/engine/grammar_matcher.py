"""RequestGrammar: one request's position in its compiled grammar, and the token mask it allows next.

Sampling masks the logits with `apply_mask` and reports each accepted token with `accept`. Speculative
decoding checks a draft with `accept_draft` (the longest prefix the grammar allows) and takes back what
verification rejects with `rollback`. A request recomputed after preemption, or arriving on a decode
worker after prefill elsewhere, gets its matcher back with `from_tokens` (state is a function of the
tokens generated so far, so nothing needs to travel).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

MAX_ROLLBACK_TOKENS = 16  # at least the longest MTP draft verified in one step (xgrammar keeps more)


class RequestGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int):
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)
        self._mask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        self.accepted = 0

    @classmethod
    def from_tokens(cls, compiled: xgr.CompiledGrammar, vocab_size: int, tokens: Sequence[int]) -> RequestGrammar:
        """The matcher after `tokens` (the output so far); ValueError if the grammar rejects them."""
        grammar = cls(compiled, vocab_size)
        for t in tokens:
            if not grammar.accept(t):
                raise ValueError(f"tokens: token {t} at output position {grammar.accepted} breaks the grammar")
        return grammar

    @property
    def terminated(self) -> bool:
        """The output is complete: only the end (a stop token) is left, or it was accepted."""
        return self._matcher.is_terminated()

    def allowed_mask(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next."""
        self._matcher.fill_next_token_bitmask(self._mask)
        bits = self._mask[0]
        ids = torch.arange(self.vocab_size)
        return ((bits[ids // 32] >> (ids % 32)) & 1).bool()

    def apply_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] (or [1, vocab]) with the disallowed tokens at -inf, in place."""
        self._matcher.fill_next_token_bitmask(self._mask)
        view = logits.view(1, -1)
        xgr.apply_token_bitmask_inplace(view, self._mask[:, : (view.shape[1] + 31) // 32])
        return logits

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (and no change) if the grammar does not allow it."""
        if self._matcher.is_terminated():
            return False
        ok = self._matcher.accept_token(int(token))
        self.accepted += ok
        return ok

    def accept_draft(self, tokens: Sequence[int]) -> int:
        """Advance through the longest allowed prefix of a draft; returns its length."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Take back the last `n` accepted tokens (rejected drafts)."""
        if n < 0 or n > min(self.accepted, MAX_ROLLBACK_TOKENS):
            raise ValueError(f"n: cannot roll back {n} of {self.accepted} accepted tokens")
        if n:
            self._matcher.rollback(n)
            self.accepted -= n
