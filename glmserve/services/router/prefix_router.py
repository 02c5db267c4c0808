"""PrefixRouter: the router's adapter between its prefill `WorkerPool`, the kvstore index, its
local view and the `PrefillRouting` policy.

Per request (on the event loop; hashing a long prompt runs in a thread, DESIGN invariant 7):

1. hash the prompt's full blocks with each healthy prefill worker's cache root and block size (as
   its Health reports them: the router computes exactly the workers' keys, and a worker with another
   model revision, tokenizer or KV layout simply never matches), salted with the tenant's salt;
2. look the reusable blocks up in the kvstore (``Lookup``; short deadline); while the kvstore or
   its index is down (its Health says so, or a lookup failed), in the router's `LocalPrefixView`;
3. build one `PrefillCandidate` per healthy worker and let the policy choose. Device blocks count
   for the worker holding them; the host tier is one CPU pool in the kvstore that every worker can
   load from, so the longest host run reported under any holder id counts for every candidate.
4. under a policy that sees hits, also the device blocks of the decode worker the request goes to
   (``local``): it holds every earlier turn it decoded, and `LocalPrefill` counts them when it
   weighs prefilling the prompt there (a decode worker does not load from the host tier).

``acquire`` / ``release`` bracket the prefill (until decode's first event): they keep the tokens
this router queued on each worker, record the prompt's blocks in the local view once the prefill
succeeded, and count the cache hits the worker reported.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from glmserve.core.block_hash import block_hashes, reusable_blocks
from glmserve.kv.block_index import PrefixMatch
from glmserve.services.kvstore.client import AsyncKVStoreClient, KVStoreError
from glmserve.services.router.backend import RequestHints
from glmserve.services.router.local_prefix_view import LocalPrefixView
from glmserve.services.router.prefill_routing import (
    PrefillCandidate,
    PrefillRouting,
    RoutingConfig,
    RoutingDecision,
)
from glmserve.services.router.routing_metrics import RoutingMetrics
from glmserve.services.router.worker_pool import WorkerPool, WorkerView

log = logging.getLogger(__name__)

HASH_OFF_LOOP_TOKENS = 8192  # longer prompts are hashed in a thread
LOOKUP_TIMEOUT_S = 0.3

RootKey = tuple[bytes, int]  # (cache root, block size)


@dataclass
class RoutedPrefill:
    """One routing decision and what is needed to settle it."""

    address: str
    decision: RoutingDecision
    worker_id: str
    num_prompt_tokens: int
    hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks, under its root
    local_hit_tokens: int = 0  # prompt tokens the decode worker holds itself (`route`'s ``local``)

    @property
    def local_compute_tokens(self) -> int:
        """What the decode worker would compute if it prefilled the prompt itself."""
        return self.num_prompt_tokens - self.local_hit_tokens


class PrefixRouter:
    def __init__(self, pool: WorkerPool, config: RoutingConfig | None = None,
                 kvstore_up: Callable[[], bool | None] = lambda: None,
                 local_view: LocalPrefixView | None = None) -> None:
        """``kvstore_up``: the latest kvstore Health verdict (None: unknown yet)."""
        self.pool, self.policy = pool, PrefillRouting(config or RoutingConfig())
        self.local_view = local_view if local_view is not None else LocalPrefixView()
        self.metrics = RoutingMetrics()
        self._kvstore_up = kvstore_up
        self._client: AsyncKVStoreClient | None = None
        self._lookup_failed = False  # the latest lookup failed: use the local view until Health is up
        self._queued_tokens: dict[str, int] = {}
        self.metrics.index_up.set(0)

    def connect(self, kvstore: str) -> None:
        """Look prefixes up in the kvstore at ``kvstore``; call inside the event loop."""
        self._client = AsyncKVStoreClient(kvstore, timeout_s=LOOKUP_TIMEOUT_S)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    def refresh_index_gauge(self) -> None:
        """Set ``glmserve_router_kv_index_up`` from the current source (before a scrape)."""
        self.metrics.index_up.set(1 if self.index_source() == "kvstore" else 0)

    def index_source(self) -> str:
        """Where lookups go now: "kvstore", or "local" (no kvstore, or it is unreachable)."""
        if self._client is None:
            return "local"
        up = self._kvstore_up()
        usable = up is True or (up is None and not self._lookup_failed)
        if up is True:
            self._lookup_failed = False
        return "kvstore" if usable and not self._lookup_failed else "local"

    # -- routing ----------------------------------------------------------------------------------

    async def route(self, prompt_ids: Sequence[int], hints: RequestHints,
                    local: WorkerView | None = None) -> RoutedPrefill | None:
        """The prefill worker for a prompt (None: no healthy one); ``local``: the decode worker the
        request goes to, whose own hit is looked up too (step 4 of the module docstring)."""
        views = [v for v in self.pool.views() if v.healthy]
        if not views:
            return None
        local = local if local is not None and self.policy.sees_hits else None
        hashes = await self._hash_per_root(views + ([local] if local else []), prompt_ids, hints.cache_salt)
        matches, source = await self._lookup(hashes, len(prompt_ids))
        candidates, block_size = [], 0
        for v in views:
            found = matches.get((v.cache_root, v.block_size), {})
            device = found.get(v.worker_id, PrefixMatch()).device_blocks
            host = max((m.host_blocks for m in found.values()), default=0)
            block_size = block_size or v.block_size
            candidates.append(PrefillCandidate(v.address, v.load, v.inflight, self._queued_tokens.get(v.address, 0),
                                               device, host, v.free_blocks))
        decision = self.policy.choose(candidates, len(prompt_ids), block_size or 1, hints.session_id,
                                      index_known=source == "kvstore")
        assert decision is not None  # candidates is not empty
        chosen = next(v for v in views if v.address == decision.address)
        return RoutedPrefill(decision.address, decision, chosen.worker_id, len(prompt_ids),
                             hashes.get((chosen.cache_root, chosen.block_size), []),
                             self._own_hit_tokens(local, matches, len(prompt_ids)))

    def queued_tokens(self, address: str) -> int:
        """Prompt tokens this router sent to ``address`` that are still being prefilled."""
        return self._queued_tokens.get(address, 0)

    def least_queued_tokens(self) -> int:
        """The fewest `queued_tokens` of a healthy prefill worker: the soonest one could start a prompt."""
        return min((self.queued_tokens(v.address) for v in self.pool.views() if v.healthy), default=0)

    def acquire(self, routed: RoutedPrefill) -> None:
        """The request goes to the routed prefill worker (counted as a decision by its reason)."""
        self.metrics.decisions.labels(reason=routed.decision.reason).inc()
        self.pool.acquire(routed.address)
        q = self._queued_tokens
        q[routed.address] = q.get(routed.address, 0) + routed.decision.compute_tokens

    def release(self, routed: RoutedPrefill, first_event: object | None) -> None:
        """The prefill ended; ``first_event``: decode's first event (None when there was none)."""
        self.pool.release(routed.address)
        q = self._queued_tokens
        q[routed.address] = max(0, q.get(routed.address, 0) - routed.decision.compute_tokens)
        if first_event is None or getattr(first_event, "finish_reason", "") == "error":
            return
        if routed.hashes and routed.worker_id:
            self.local_view.stored(routed.worker_id, routed.hashes)
        cached = int(getattr(first_event, "num_cached_tokens", 0))
        self.metrics.served(routed.num_prompt_tokens, cached, routed.decision.host_hit_tokens)

    def served_locally(self, routed: RoutedPrefill, first_event: object | None) -> None:
        """The decode worker prefilled the prompt itself (`LocalPrefill`); its own prefix cache
        served ``num_cached_tokens`` of it (no prefill worker holds the prompt now)."""
        if first_event is None or getattr(first_event, "finish_reason", "") == "error":
            return
        self.metrics.served(routed.num_prompt_tokens, int(getattr(first_event, "num_cached_tokens", 0)), 0)

    # -- parts ------------------------------------------------------------------------------------

    @staticmethod
    def _own_hit_tokens(view: WorkerView | None, matches: dict[RootKey, dict[str, PrefixMatch]], n: int) -> int:
        """Leading tokens of an ``n``-token prompt that ``view``'s worker holds on its device."""
        if view is None or not view.worker_id or view.block_size <= 0:
            return 0
        found = matches.get((view.cache_root, view.block_size), {}).get(view.worker_id, PrefixMatch())
        return min(found.device_blocks, reusable_blocks(n, view.block_size)) * view.block_size

    async def _hash_per_root(self, views: list[WorkerView], prompt_ids: Sequence[int],
                             salt: str | None) -> dict[RootKey, list[bytes]]:
        keys = {(v.cache_root, v.block_size) for v in views if v.cache_root and v.block_size > 0}

        def compute() -> dict[RootKey, list[bytes]]:
            return {(root, bs): block_hashes(root, prompt_ids, bs, salt=salt) for root, bs in keys}

        if len(prompt_ids) * max(len(keys), 1) > HASH_OFF_LOOP_TOKENS:
            return await asyncio.to_thread(compute)
        return compute()

    async def _lookup(self, hashes: dict[RootKey, list[bytes]],
                      n: int) -> tuple[dict[RootKey, dict[str, PrefixMatch]], str]:
        """Per root, the matches of the prompt's reusable blocks, and where they came from."""
        wanted = {key: hs[: reusable_blocks(n, key[1])] for key, hs in hashes.items()}
        source = self.index_source()
        out: dict[RootKey, dict[str, PrefixMatch]] = {}
        if source == "kvstore" and self._client is not None:
            try:
                for key, hs in wanted.items():
                    out[key] = await self._client.lookup(hs) if hs else {}
            except KVStoreError as e:
                if not self._lookup_failed:
                    log.warning("prefix lookup failed, routing from the local view: %s", e)
                self._lookup_failed, source, out = True, "local", {}
        if source == "local":
            out = {key: self.local_view.match(hs) for key, hs in wanted.items()}
        self.metrics.index_up.set(1 if source == "kvstore" else 0)
        hit = any(m.device_blocks or m.host_blocks for ms in out.values() for m in ms.values())
        self.metrics.lookups.labels(source=source, result="hit" if hit else "miss").inc()
        return out, source
