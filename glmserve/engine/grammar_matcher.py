"""RequestGrammar: one request's position in its compiled grammar, and the tokens it allows next.

The engine masks the logits with `fill` (xgrammar's bitmask layout) before sampling and reports
each token the request keeps with `accept`. Speculative decoding: each MTP draft is chosen under
`draft_mask` and pushed with `add_draft`, so drafts always follow the grammar; verification asks
`verify_masks(drafts)` for the mask at every drafted position, which takes the drafts back out of
the matcher (rollback) so only what verification keeps is accepted afterwards. Drafts the
scheduler dropped are taken back the same way at the next call. A request recomputed after
preemption keeps its matcher (its output does not change); one arriving on a decode worker after
prefill elsewhere gets it rebuilt by `from_tokens` (state is a function of the output tokens, so
nothing needs to travel).

Reasoning (`GrammarSpec.reasoning`): "enabled" lets reasoning text through up to `</think>` and
starts the grammar after it; "auto" also allows an opening `<think>` as the first token (else the
grammar starts at once). After the grammar's end (a stop token accepted, e.g. with ``ignore_eos``)
nothing is constrained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from glmserve.core.grammar_spec import GrammarSpec
from glmserve.engine.grammar_tokens import KEY, OUTSIDE, THINK, VALUE, GrammarTokens, unpack_bits

ALL_ALLOWED = -1  # an int32 word with every bit set
# What became of an accepted token.
REASONING, FED, AFTER_END = 0, 1, 2


def _set_bit(row: torch.Tensor, token: int) -> None:
    word, bit = divmod(token, 32)
    value = (int(row[word]) & 0xFFFFFFFF) | (1 << bit)
    row[word] = value - 2**32 if value >= 2**31 else value


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Disallowed tokens of each row of ``logits`` [N, V] (float32) to -inf, in place (``masks``
    [N, num_words] int32, as `RequestGrammar.fill` writes them)."""
    xgr.apply_token_bitmask_inplace(logits, masks.to(logits.device))


@dataclass(frozen=True, slots=True)
class _Entry:
    """One accepted token and the state after it (kept per token, so rollback is a pop)."""

    token: int
    what: int  # REASONING | FED | AFTER_END
    region: int  # grammar_tokens.OUTSIDE | THINK | KEY | VALUE, read from the text
    tail: bytes  # the end of the text, to find tags spanning tokens
    started: bool  # the grammar has begun (reasoning is over, or there was none)


class RequestGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar, spec: GrammarSpec, tokens: GrammarTokens):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._tokens = tokens
        self._json = spec.kind != "tool_calls"
        self._reasoning = spec.reasoning
        self._start = _Entry(-1, REASONING, THINK if spec.reasoning == "enabled" else OUTSIDE, b"",
                             spec.reasoning == "disabled")
        self._log: list[_Entry] = []
        self._drafted: list[int] = []  # drafts in the matcher, not yet verified
        self._draft_masks: list[torch.Tensor] = []

    @classmethod
    def from_tokens(cls, compiled: xgr.CompiledGrammar, spec: GrammarSpec, tokens: GrammarTokens,
                    output: Sequence[int]) -> RequestGrammar:
        """The matcher after ``output`` (the tokens generated so far); ValueError if they break it."""
        grammar = cls(compiled, spec, tokens)
        for i, t in enumerate(output):
            if not grammar.accept(t):
                raise ValueError(f"tokens: token {t} at output position {i} breaks the grammar")
        return grammar

    @property
    def num_words(self) -> int:
        return self._tokens.num_words

    @property
    def num_accepted(self) -> int:
        return len(self._log)

    @property
    def _last(self) -> _Entry:
        return self._log[-1] if self._log else self._start

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token taken: nothing is constrained any more."""
        return self._last.started and self._matcher.is_terminated()

    # --- masks ----------------------------------------------------------------------------------

    def fill(self, out: torch.Tensor, row: int = 0) -> None:
        """Write the mask of the next token into ``out[row]`` (``out``: [N, num_words] int32)."""
        last = self._last
        if not last.started:
            if last.region == THINK:  # free text, then </think>
                out[row] = self._tokens.reasoning
                return
            self._fill_grammar(out, row, last)  # "auto", first token: the grammar, or <think>
            if self._tokens.think_start is not None:
                _set_bit(out[row], self._tokens.think_start)
            return
        if self._matcher.is_terminated():
            out[row] = ALL_ALLOWED
            return
        self._fill_grammar(out, row, last)

    def _fill_grammar(self, out: torch.Tensor, row: int, last: _Entry) -> None:
        self._matcher.fill_next_token_bitmask(out, row)
        if self._json:
            out[row] &= self._tokens.json_filter
        elif last.region in (KEY, VALUE):
            out[row] &= self._tokens.only[self._tokens.closer[last.region]]

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens allowed next (tests, debugging)."""
        out = torch.empty(1, self.num_words, dtype=torch.int32)
        self.fill(out)
        return unpack_bits(out[0], self._tokens.vocab_size)

    # --- tokens ---------------------------------------------------------------------------------

    def accept(self, token: int) -> bool:
        """Advance by one kept token; False (and no change) if the grammar does not allow it."""
        self._settle()
        return self._push(int(token))

    def _push(self, token: int) -> bool:
        last, t = self._last, self._tokens
        region, tail = t.advance_region(last.region, last.tail, token)
        started = last.started or (not self._log and self._reasoning == "auto" and token != t.think_start)
        if not started:  # reasoning: any text, no special token but the ones that open and close it
            opening = token == t.think_start and not self._log and self._reasoning == "auto"
            if token in t.special_ids and token != t.think_end and not opening:
                return False
            self._log.append(_Entry(token, REASONING, region, tail, region != THINK))
            return True
        if self._matcher.is_terminated():
            what = AFTER_END
        elif self._matcher.accept_token(token):
            what = FED
        else:
            return False
        self._log.append(_Entry(token, what, region, tail, True))
        return True

    def rollback(self, n: int) -> None:
        """Take back the last ``n`` accepted tokens."""
        self._settle()
        self._pop(n)

    def _pop(self, n: int) -> None:
        if not 0 <= n <= len(self._log):
            raise ValueError(f"n: cannot roll back {n} of {len(self._log)} accepted tokens")
        if n == 0:
            return
        fed = sum(1 for e in self._log[len(self._log) - n :] if e.what == FED)
        del self._log[len(self._log) - n :]
        if fed:
            self._matcher.rollback(fed)

    # --- speculative drafts ---------------------------------------------------------------------

    def draft_mask(self, position: int) -> torch.Tensor:
        """The mask [1, num_words] for the draft at ``position`` (0 = the first of a new round)."""
        if position == 0:
            self._settle()
        mask = torch.empty(1, self.num_words, dtype=torch.int32)
        self.fill(mask)
        self._draft_masks.append(mask)
        return mask

    def add_draft(self, token: int) -> bool:
        """Put a draft (chosen under `draft_mask`) into the matcher until it is verified."""
        ok = self._push(int(token))
        if ok:
            self._drafted.append(int(token))
        return ok

    def verify_masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """[len(drafts) + 1, num_words]: the mask at each position verification scores (after the
        first i drafts), then the drafts are taken back out of the matcher."""
        drafts = [int(t) for t in drafts]
        n = len(drafts)
        if self._drafted == drafts and len(self._draft_masks) == n:
            masks = torch.empty(n + 1, self.num_words, dtype=torch.int32)
            if n:
                masks[:n] = torch.cat(self._draft_masks)
            self.fill(masks, n)
            self._settle()
            return masks
        self._settle()
        masks = torch.full((n + 1, self.num_words), ALL_ALLOWED, dtype=torch.int32)
        pushed = 0
        for j, t in enumerate(drafts):
            self.fill(masks, j)
            if not self._push(t):  # verification rejects it (masked); later rows do not matter
                break
            pushed += 1
        else:
            self.fill(masks, n)
        self._pop(pushed)
        return masks

    def _settle(self) -> None:
        """Take unverified drafts back out of the matcher."""
        if self._drafted:
            self._pop(len(self._drafted))
        self._drafted, self._draft_masks = [], []
