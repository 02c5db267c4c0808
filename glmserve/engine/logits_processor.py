"""LogitsProcessor: what changes a request's logits before the sampler (grammar mask, logit_bias,
repetition / presence / frequency penalties, banned tokens), and the per-request state it needs.

The engine calls it at four points of a step, and nothing else of it knows about grammars:

- `attach(req)` when a request arrives (validates; compiles or reuses its grammar; rebuilds the
  matcher from the output so far, so a request arriving after prefill elsewhere is rebuilt here);
- `adjust(work, logits)` after the main forward: a copy of each affected item's logits, every row
  processed for the tokens before it (a decode item's row i follows its first i drafts), so
  sampling and draft verification see what non-speculative decoding would see;
- `draft_logits` / `drafted` while MTP drafts: drafts are chosen under the grammar and the bans, so
  the masks of the later positions exist (penalties are left out of drafts: verification stays
  lossless);
- `kept(req, tokens)` once tokens are final (the grammar advances; counts grow).

The raw logits stay untouched: logprobs are reported under the model's distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glmserve.engine.penalties import apply_bans, apply_logit_bias, apply_penalties
from glmserve.engine.request import Request
from glmserve.engine.scheduler import ScheduledWork
from glmserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class RequestLogits:
    """``grammar``: a `RequestGrammar` or None; ``seen`` [V] bool: tokens of the prompt and the
    output (repetition penalty); ``counts`` [V] float32: occurrences in the output (penalties)."""

    grammar: object | None
    seen: torch.Tensor | None
    counts: torch.Tensor | None


class LogitsProcessor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, grammars=None):
        """``grammars``: a `GrammarCache` to share (engines of one process, tests); else one is
        made on first use (xgrammar is only imported when a request has a grammar)."""
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._grammars = grammars

    @property
    def grammars(self):
        from glmserve.engine.grammar_cache import GrammarCache

        if self._tokenizer is None:
            raise ValueError("grammar: constrained decoding needs an engine with a tokenizer")
        if self._grammars is None:
            self._grammars = GrammarCache(self._tokenizer, self.vocab_size)
        return self._grammars

    def attach(self, req: Request) -> None:
        """Set ``req.logits`` (None when nothing applies); ValueError naming the field if invalid."""
        p = req.params
        req.logits = None
        if not p.adjusts_logits:
            return
        for name, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("banned_token_ids", p.banned_token_ids)):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name}: token ids out of range (vocabulary of {self.vocab_size}): {bad[:5]}")
        grammar = None
        if p.grammar is not None:
            from glmserve.engine.grammar_matcher import RequestGrammar

            cache = self.grammars
            grammar = RequestGrammar.from_tokens(cache.get(p.grammar), p.grammar, cache.tokens, req.generated_ids)
        seen = counts = None
        if p.has_penalties:
            counts = torch.zeros(self.vocab_size)
            generated = req.generated_ids
            counts.index_add_(0, torch.tensor(generated, dtype=torch.long), torch.ones(len(generated)))
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(self.vocab_size, dtype=torch.bool)
                seen[torch.tensor(req.token_ids, dtype=torch.long)] = True
        req.logits = RequestLogits(grammar, seen, counts)

    def adjust(self, work: Sequence[ScheduledWork], logits: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Per work item: its logits, processed (a copy) where the request needs it."""
        out = list(logits)
        for i, w in enumerate(work):
            if w.request.logits is not None and logits[i] is not None:
                out[i] = self._processed(w.request, logits[i], w.request.drafts if w.is_decode else [])
        return out

    def first_token_logits(self, req: Request, logits: torch.Tensor) -> torch.Tensor:
        """The logits [1, V] a prefill samples its first token from (a LayerSplit stage computes
        them outside a step): processed when the request needs it, else as they are."""
        return logits if req.logits is None else self._processed(req, logits, [])

    def _processed(self, req: Request, rows: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        state, p = req.logits, req.params
        x = rows.float().clone()
        apply_logit_bias(x, p)
        if state.counts is not None:
            counts = state.counts.expand_as(x).clone()
            seen = state.seen.expand_as(x).clone() if state.seen is not None else None
            for j, t in enumerate(drafts):  # row j + 1 comes after draft j
                counts[j + 1 :, t] += 1
                if seen is not None:
                    seen[j + 1 :, t] = True
            apply_penalties(x, p, seen, counts)
        apply_bans(x, p)
        if state.grammar is not None:
            from glmserve.engine.grammar_matcher import apply_masks

            apply_masks(x, state.grammar.verify_masks(drafts))
        return x

    def draft_logits(self, req: Request, logits: torch.Tensor) -> torch.Tensor:
        """The MTP logits [V] of the next draft: the banned tokens out, masked by the grammar after
        the drafts so far."""
        grammar = req.logits.grammar if req.logits is not None else None
        if grammar is None and not req.params.banned_token_ids:
            return logits
        x = logits.float().clone().view(1, -1)
        apply_bans(x, req.params)
        if grammar is not None:
            from glmserve.engine.grammar_matcher import apply_masks

            apply_masks(x, grammar.draft_mask(len(req.drafts)))
        return x[0]

    def drafted(self, req: Request, token: int) -> None:
        if req.logits is not None and req.logits.grammar is not None:
            req.logits.grammar.add_draft(token)

    def kept(self, req: Request, tokens: list[int]) -> None:
        state = req.logits
        if state is None or not tokens:
            return
        if state.grammar is not None:
            for t in tokens:
                if not state.grammar.accept(t):  # cannot happen for tokens sampled under the mask
                    log.error("request %s: token %d breaks its grammar; no longer constrained", req.request_id, t)
                    state.grammar = None
                    break
        if state.counts is not None:
            ids = torch.tensor(tokens, dtype=torch.long)
            state.counts.index_add_(0, ids, torch.ones(len(tokens)))
            if state.seen is not None:
                state.seen[ids] = True
