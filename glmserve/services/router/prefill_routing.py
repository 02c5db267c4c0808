"""PrefillRouting: which prefill worker computes a prompt, from its cached prefix and its queue.

Pure policy (no I/O): the router's backend gathers one `PrefillCandidate` per healthy prefill
worker (its load, the tokens this router already queued there, and the leading blocks of this
prompt it holds per tier, from the kvstore index or the router's local view) and asks `choose`.

Cost of a candidate, in tokens of prefill work before this request's first token:

    cost = (prompt tokens - device hit - host_credit * extra host hit) + queued tokens

Device hits get full credit; blocks only on the host tier still have to be loaded, so they get
``host_credit`` (0..1). The default 0.95 is what loading costs against computing here: a 16K-token
host hit loaded its 255 blocks in 28 ms and cost 0.2% of the cold prefill (docs/benchmarks.md,
"Host KV tier"). A lower credit makes the router pile requests on the worker that holds a prefix
on device although any worker could load it almost as fast. Queued tokens: what this router sent there and is still being prefilled,
plus ``unknown_request_tokens`` for each request the worker reports beyond those (other routers).
The lowest cost wins; exact ties go round robin.

Guards, in order:

1. Session affinity: a session's turn goes to the worker of its previous turn (while the TTL
   lasts) unless that worker is overloaded: more than ``max_imbalance`` requests above the least
   loaded candidate, or out of free blocks.
2. Herding guard (many requests sharing one system prompt must not all pile on the one worker
   that cached it first): a cache hit may buy at most ``max_imbalance`` requests of extra load; and
   when the hit is only a shared prefix (under ``shared_prefix_fraction`` of the prompt), it buys
   none: the request goes to the least loaded candidate, which then caches that prefix too.

Reasons (for metrics): ``session``, ``cache_hit`` (the winner holds part of the prompt),
``load`` (no candidate holds any of it), ``herding_guard``, and ``fallback`` when the index could
not be asked and no candidate's hit is known (the decision is by load alone).

``policy`` (the router's ``--routing``): ``cache_aware`` is all of the above; ``least_loaded`` the
same cost told of no cache hits and no sessions (load balance alone, reason ``load``);
``round_robin`` takes the candidates in turn whatever their load (reason ``round_robin``). The last
two are baselines for measuring what cache awareness buys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from glmserve.core.block_hash import reusable_blocks
from glmserve.services.router.session_affinity import SessionAffinity

REASONS = ("cache_hit", "session", "load", "herding_guard", "fallback", "round_robin")
POLICIES = ("cache_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class RoutingConfig:
    host_credit: float = 0.95
    max_imbalance: int = 4
    shared_prefix_fraction: float = 0.5
    unknown_request_tokens: int = 512
    session_ttl_s: float = 600.0
    policy: str = "cache_aware"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0.0 <= self.host_credit <= 1.0:
            raise ValueError(f"host_credit: must be in [0, 1], got {self.host_credit}")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance: must be >= 0, got {self.max_imbalance}")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError(f"shared_prefix_fraction: must be in [0, 1], got {self.shared_prefix_fraction}")
        if self.unknown_request_tokens < 0:
            raise ValueError(f"unknown_request_tokens: must be >= 0, got {self.unknown_request_tokens}")
        if self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s: must be > 0, got {self.session_ttl_s}")


@dataclass(frozen=True)
class PrefillCandidate:
    address: str
    load: int = 0  # requests running or queued there (the larger of its report and our count)
    inflight: int = 0  # of those, requests this router sent and knows the tokens of
    queued_tokens: int = 0  # prompt tokens still to prefill of those requests
    device_blocks: int = 0  # leading blocks of this prompt it holds on device
    host_blocks: int = 0  # leading blocks of this prompt held for it on the host tier
    free_blocks: int = 1  # 0: its pool is full (never a session's home then)


@dataclass(frozen=True)
class RoutingDecision:
    address: str
    reason: str
    device_hit_tokens: int  # prompt tokens expected from its device tier
    host_hit_tokens: int  # further prompt tokens expected from the host tier
    compute_tokens: int  # prompt tokens it is expected to compute


class PrefillRouting:
    """See the module docstring. Not thread-safe: the router's event loop owns it."""

    def __init__(self, config: RoutingConfig = RoutingConfig(), sessions: SessionAffinity | None = None):
        self.config = config
        self.sessions = sessions if sessions is not None else SessionAffinity(config.session_ttl_s)
        self._turn = 0  # round-robin cursor for exact ties

    @property
    def sees_hits(self) -> bool:
        """Whether this policy is told of cache hits (the baselines are not)."""
        return self.config.policy == "cache_aware"

    def choose(self, candidates: Sequence[PrefillCandidate], num_prompt_tokens: int, block_size: int,
               session_id: str | None = None, index_known: bool = True) -> RoutingDecision | None:
        """The worker for a prompt of ``num_prompt_tokens`` (None without candidates).
        ``index_known``: False when neither the index nor a local view could be asked."""
        if not candidates:
            return None
        if not self.sees_hits:
            return self._baseline(candidates, num_prompt_tokens)
        reusable = reusable_blocks(num_prompt_tokens, block_size) * block_size
        hits = {c.address: self._hits(c, reusable, block_size) for c in candidates}
        min_load = min(c.load for c in candidates)
        decision = self._session(candidates, session_id, min_load, num_prompt_tokens, hits)
        if decision is None:
            decision = self._by_cost(candidates, num_prompt_tokens, hits, min_load, index_known)
        if session_id:
            self.sessions.record(session_id, decision.address)
        return decision

    # -- parts ------------------------------------------------------------------------------------

    def _baseline(self, candidates: Sequence[PrefillCandidate], n: int) -> RoutingDecision:
        """``least_loaded`` or ``round_robin``: no hits, no sessions."""
        none = (0, 0)
        if self.config.policy == "round_robin":
            chosen = candidates[self._turn % len(candidates)]
            self._turn = (self._turn + 1) % len(candidates)
            return self._decision(chosen, "round_robin", n, none)
        return self._decision(self._cheapest(candidates, n, {c.address: none for c in candidates}), "load", n, none)

    def _hits(self, c: PrefillCandidate, reusable: int, block_size: int) -> tuple[int, int]:
        device = min(c.device_blocks * block_size, reusable)
        host = max(0, min(c.host_blocks * block_size, reusable) - device)
        return device, host

    def _queued(self, c: PrefillCandidate) -> float:
        return c.queued_tokens + max(0, c.load - c.inflight) * self.config.unknown_request_tokens

    def _cost(self, c: PrefillCandidate, n: int, hit: tuple[int, int]) -> float:
        return n - hit[0] - self.config.host_credit * hit[1] + self._queued(c)

    def _decision(self, c: PrefillCandidate, reason: str, n: int, hit: tuple[int, int]) -> RoutingDecision:
        return RoutingDecision(c.address, reason, hit[0], hit[1], n - hit[0] - hit[1])

    def _session(self, candidates: Sequence[PrefillCandidate], session_id: str | None, min_load: int,
                 n: int, hits: dict[str, tuple[int, int]]) -> RoutingDecision | None:
        home = self.sessions.get(session_id) if session_id else None
        for c in candidates:
            if c.address == home and c.free_blocks > 0 and c.load <= min_load + self.config.max_imbalance:
                return self._decision(c, "session", n, hits[c.address])
        return None

    def _by_cost(self, candidates: Sequence[PrefillCandidate], n: int, hits: dict[str, tuple[int, int]],
                 min_load: int, index_known: bool) -> RoutingDecision:
        best = self._cheapest(candidates, n, hits)
        hit = hits[best.address]
        if hit == (0, 0):
            return self._decision(best, "load" if index_known else "fallback", n, hit)
        over = best.load > min_load + self.config.max_imbalance
        shared_only = hit[0] + hit[1] < self.config.shared_prefix_fraction * n and best.load > min_load
        if over or shared_only:
            allowed = [c for c in candidates if c.load <= min_load + (0 if shared_only else self.config.max_imbalance)]
            guarded = self._cheapest(allowed, n, hits)
            return self._decision(guarded, "herding_guard", n, hits[guarded.address])
        return self._decision(best, "cache_hit", n, hit)

    def _cheapest(self, candidates: Sequence[PrefillCandidate], n: int,
                  hits: dict[str, tuple[int, int]]) -> PrefillCandidate:
        k = len(candidates)
        ranked = sorted(range(k), key=lambda i: (self._cost(candidates[i], n, hits[candidates[i].address]),
                                                 candidates[i].load, (i - self._turn) % k))
        self._turn = (ranked[0] + 1) % k
        return candidates[ranked[0]]
