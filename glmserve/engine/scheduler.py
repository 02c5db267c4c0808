"""Scheduler: continuous batching with chunked prefill, preemption by recomputation, and abort.

Each step: every running request in decode gets its pending token plus its drafts verified; prefills
(new or resumed) take what is left of the step's token budget in chunks, so a long prompt never stalls
decoding. A waiting prompt that would not finish in a step that already computes another prompt waits
for the next step: on a CPU its tokens cost the same then, and the other prompt's first token comes
without waiting for them. Prompts that fit share a step only up to ``max_shared_prompt_tokens`` prompt
tokens: below it a step's fixed work outweighs the wait; beyond it each prompt that joins delays the
first tokens of those already in the step by its own compute. When blocks run out, the most
recently arrived running request is preempted: its blocks are freed and it waits to be recomputed.
Waiting requests are admitted by (priority, arrival).
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

from glmserve.engine.kv_cache_manager import KVCacheManager
from glmserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_step_tokens: int = 2048  # main-model tokens per step (chunked-prefill budget)
    max_shared_prompt_tokens: int = 512  # prompt tokens several prompts may share a step with

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs: must be >= 1")
        if self.max_step_tokens < 1:
            raise ValueError("max_step_tokens: must be >= 1")
        if self.max_shared_prompt_tokens < 1:
            raise ValueError("max_shared_prompt_tokens: must be >= 1")


@dataclass(frozen=True)
class ScheduledWork:
    request: Request
    num_new: int  # tokens run through the main model this step, starting at request.num_computed
    is_decode: bool  # fixed when scheduled: the request's state changes once the step has run


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.running: list[Request] = []
        self._waiting: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (req.priority, req.arrival, next(self._order), req))

    def remove(self, req: Request, free_blocks: bool = True) -> None:
        """Take a request out (finished or aborted); its blocks are freed at once unless the caller
        keeps them (a prefill-only request whose KV still has to be shipped)."""
        if req in self.running:
            self.running.remove(req)
        else:
            self._waiting = [w for w in self._waiting if w[3] is not req]
            heapq.heapify(self._waiting)
        if free_blocks:
            self.kv.free(req)
        req.drafts, req.draft_probs = [], None

    def adopt(self, req: Request) -> None:
        """Run a request whose prompt KV is already in its blocks (written by a prefill worker)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def schedule(self) -> list[ScheduledWork]:
        budget = self.config.max_step_tokens
        work: list[ScheduledWork] = []
        prompt_tokens = 0  # this step's
        for req in list(self.running):
            if req not in self.running:  # preempted while making room for an earlier request
                continue
            n = self._tokens_wanted(req, budget)
            if n == 0 or not self._make_room(req, req.num_computed + n):
                continue
            work.append(ScheduledWork(req, n, not req.in_prefill))
            budget -= n
            prompt_tokens += n if req.in_prefill else 0
        while self._waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._waiting[0][3]
            self.kv.match_prefix(req)
            n = self._tokens_wanted(req, budget)
            if n < self._prompt_left(req) and prompt_tokens:
                break  # it would only be started here: the next step, after this one's prompts
            if prompt_tokens and prompt_tokens + n > self.config.max_shared_prompt_tokens:
                break  # it would delay this step's prompts more than the step's fixed work saves
            if not self.kv.ensure(req, req.num_computed + n):
                break  # no room: keep arrival order, try again next step
            heapq.heappop(self._waiting)
            if req.scheduled_time is None:  # a preempted request keeps its first admission
                req.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            work.append(ScheduledWork(req, n, not req.in_prefill))
            budget -= n
            prompt_tokens += n
        return work

    @staticmethod
    def _prompt_left(req: Request) -> int:
        """Tokens still to compute before the request samples (0 once it decodes)."""
        if not req.in_prefill:
            return 0
        return req.num_tokens - (1 if req.output_ids else 0) - req.num_computed

    def _tokens_wanted(self, req: Request, budget: int) -> int:
        if req.in_prefill:
            return min(self._prompt_left(req), budget)
        want = 1 + len(req.drafts)
        if want > budget:  # drafts are optional; the pending token is not
            req.drafts, req.draft_probs = [], None
            want = 1
        return want if want <= budget else 0

    def _make_room(self, req: Request, num_tokens: int) -> bool:
        while not self.kv.ensure(req, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Free everything; the request restarts from its prompt plus what it already generated."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed = req.mtp_synced = 0
        req.mtp_pending = []
        req.drafts, req.draft_probs = [], None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)
