"""MTPDrafter: the next step's draft tokens from the model's MTP layer, and that layer's KV kept in
step with the main model (DESIGN invariant 5: drafts only ever propose; verification decides).

After each step's main forward the engine hands over, per request, the hidden rows that step
computed (`DraftItem`). Prompt positions always get MTP KV (later drafts attend to them). How many
drafts to propose is the `SpecPolicy`'s choice (``mtp="auto"``) or fixed; a decode step that wants
none keeps its hidden rows pending instead (at most ``MAX_PENDING_MTP_ROWS``), and the next drafting
step runs them all, so switching speculation off and on leaves no hole in the MTP layer's KV.
Cost per step: one MTP forward over the step's new positions, then ``k - 1`` one-token forwards.
"""

from __future__ import annotations

import torch

from glmserve.engine.kv_cache_manager import KVCacheManager
from glmserve.engine.logits_processor import LogitsProcessor
from glmserve.engine.model_runner import ModelRunner
from glmserve.engine.request import Request
from glmserve.engine.sampler import processed_probs
from glmserve.engine.scheduler import Scheduler
from glmserve.engine.spec_policy import SpecPolicy
from glmserve.model.mtp_draft import extend_shared_topk

# Decode positions an idle MTP layer may fall behind before its KV gets a hole (bounded memory).
MAX_PENDING_MTP_ROWS = 256

DraftItem = tuple[Request, int, torch.Tensor, bool]
"""(request, its first position computed this step, the step's hidden rows for it, was it decoding)."""


class MTPDrafter:
    """``max_drafts``: the most drafts per step; ``fixed_drafts``: always that many (None: the policy
    chooses); ``share_topk``: the model's ``index_share_for_mtp_iteration``; ``logits``: the
    engine's `LogitsProcessor` (drafts are chosen under each request's grammar, so they always
    follow it and verification has the mask of every drafted position)."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, scheduler: Scheduler, max_drafts: int,
                 fixed_drafts: int | None, share_topk: bool, logits: LogitsProcessor | None = None) -> None:
        self.runner, self.kv, self.scheduler = runner, kv, scheduler
        self.logits = logits
        self.policy = SpecPolicy(max_drafts)
        self.fixed_drafts = fixed_drafts
        self._share_topk = share_topk

    def learn(self, batch: int, verified_drafts: int, verify_s: float, gained: int,
              drafted: int | None, draft_s: float) -> None:
        """What a pure decode step cost: verifying ``verified_drafts`` per request, then drafting."""
        self.policy.record_step(batch, verified_drafts, verify_s, gained)
        if drafted is not None:
            self.policy.record_drafting(batch, drafted, draft_s)

    def draft(self, items: list[DraftItem]) -> int:
        """Bring each request's MTP KV up to date with this step's hidden states, then draft (see the
        module docstring); returns the number of drafts chosen."""
        decoding = [r for r, _, _, _ in items if not r.in_prefill and not r.is_finished]
        k = self.fixed_drafts
        if k is None:  # only pure decode steps are measured: no exploring while prompts still run
            steady = not self.scheduler.num_waiting and not any(r.in_prefill for r in self.scheduler.running)
            k = self.policy.choose(len(decoding), measurable=steady)
        reqs, starts, hidden, next_tokens = [], [], [], []
        for req, start, rows, was_decode in items:
            if was_decode and k == 0:
                self._defer(req, start, rows)
                continue
            pending = req.mtp_pending  # covers positions mtp_synced .. start - 1 when not empty
            first = req.mtp_synced if pending else max(req.mtp_synced, start)
            reqs.append(req)
            starts.append(first)
            hidden.append(torch.cat([*pending, rows[max(first, start) - start : req.num_computed - start]]))
            next_tokens.append(req.token_ids[first + 1 : req.num_computed + 1])
            req.mtp_synced, req.mtp_pending = req.num_computed, []
        if not reqs:
            return k
        if k == 0:  # no draft wanted: the MTP layer's KV is all that is needed
            self.runner.store_mtp_kv(reqs, starts, hidden, next_tokens)
            return k
        result = self.runner.run_mtp(reqs, starts, hidden, next_tokens)
        picks = [
            i for i, r in enumerate(reqs)
            if not r.in_prefill and not r.is_finished and self.kv.ensure(r, r.num_computed + k + 1)
        ]
        self._draft_steps([reqs[i] for i in picks], result.hidden[picks], result.logits[picks],
                          [result.topk[i] for i in picks], k)
        return k

    @staticmethod
    def _defer(req: Request, start: int, rows: torch.Tensor) -> None:
        """Keep this step's hidden rows for the MTP layer until drafting resumes (bounded)."""
        if req.mtp_synced < start and not req.mtp_pending:
            req.mtp_synced = start  # an older hole stays (rows dropped at the cap below)
        req.mtp_pending.append(rows[: req.num_computed - start])
        if req.num_computed - req.mtp_synced > MAX_PENDING_MTP_ROWS:
            req.mtp_synced, req.mtp_pending = req.num_computed, []

    def _draft_steps(self, reqs, hidden, logits, topk, k: int) -> None:
        if not reqs:
            return
        for j in range(k):
            for i, req in enumerate(reqs):
                token, q = self._propose(req, logits[i])
                req.drafts.append(token)
                if q is not None:
                    req.draft_probs = q[None] if req.draft_probs is None else torch.cat([req.draft_probs, q[None]])
            if j == k - 1:
                return
            positions = [r.num_computed + j for r in reqs]
            shared = None
            if self._share_topk:
                shared = [extend_shared_topk(t, r.num_computed - 1, j + 1) for t, r in zip(topk, reqs, strict=True)]
            result = self.runner.run_mtp(reqs, positions, list(hidden.split(1)), [[r.drafts[-1]] for r in reqs], shared)
            hidden, logits = result.hidden, result.logits
            if not self._share_topk:
                topk = result.topk

    def _propose(self, req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.logits is not None:
            logits = self.logits.draft_logits(req, logits)
        q = None if req.params.is_greedy else processed_probs(logits[None], [req.params])[0]
        token = int(logits.argmax()) if q is None else int(torch.multinomial(q, 1, generator=req.generator))
        if self.logits is not None:
            self.logits.drafted(req, token)
        return token, q
