"""Trace replay: prefix-cache hit ratio and cache-aware vs round-robin routing on the Mooncake trace.

Replays ``bench/traces/mooncake_synthetic_trace.jsonl`` (3,993 requests, one hash id per
512-token block, prefix-chained) scaled down: every hash id becomes a fixed pseudo-random block of
``--tokens-per-id`` token ids (the same id always gives the same tokens, so the sharing structure is
the trace's); a prompt's last id is shortened in proportion to the trace's partial last block.

What runs is engine-level and in process (no HTTP, no model forward): for each prefill worker the
real ``BlockPool`` and ``KVCacheManager`` (chained block hashes under a real ``CacheKeyRoot``,
prefix lookup, commit, LRU eviction), its pool events going through the real ``KVEventPublisher``
into an ``InMemoryBlockIndex``; the router hashes each prompt, looks it up in that index and lets the
real ``PrefillRouting`` policy choose. Prefill compute is modelled, not run: a worker computes
``--rate`` prompt tokens per simulated second, one request at a time, so that queueing (which the
policy weighs against cache hits) exists; the default rate puts two workers at 80% utilization
without any cache. Reported:

- hit ratio: prompt tokens served from the cache / prompt tokens, vs the ideal (one unbounded cache
  that sees every request, same scaled prompts); the trace's own ideal at 512-token blocks is 64%;
- simulated time to first token (queue wait + compute at ``--rate``), mean and p90;
- for cache-aware routing, the share of decisions per reason.

At two per-worker cache sizes (``--cache-blocks``), for round robin, least-loaded (the same policy
told of no cache hits: load balance alone) and cache-aware routing over 2 prefill workers. About two
minutes on 2 cores with the defaults.

    python bench/bench_trace_replay.py [--requests 3993 --tokens-per-id 32 --block-size 16 ...]
"""

from __future__ import annotations

import argparse
import collections
import heapq
import math
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import RunMonitor, markdown_table, print_header  # noqa: E402
from bench.trace_variants import VARIANTS, TraceRow, read_rows  # noqa: E402
from glmserve.core.block_hash import CacheKeyRoot, block_hashes, reusable_blocks  # noqa: E402
from glmserve.core.generation import SamplingParams  # noqa: E402
from glmserve.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from glmserve.engine.request import Request  # noqa: E402
from glmserve.kv.block_index import InMemoryBlockIndex  # noqa: E402
from glmserve.kv.block_pool import BlockPool  # noqa: E402
from glmserve.services.kv_events import KVEventPublisher  # noqa: E402
from glmserve.services.kvstore.client import BlockEvent, KVStoreHealth  # noqa: E402
from glmserve.services.router.prefill_routing import (  # noqa: E402
    PrefillCandidate,
    PrefillRouting,
    RoutingConfig,
)

TRACE = REPO / "bench" / "traces" / "mooncake_synthetic_trace.jsonl"
TRACE_BLOCK = 512
PARAMS = SamplingParams(max_tokens=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--requests", type=int, default=3993, help="replay the first N requests")
    p.add_argument("--tokens-per-id", type=int, default=32, help="tokens per 512-token trace block")
    p.add_argument("--block-size", type=int, default=16, help="KV block size of the pools")
    p.add_argument("--cache-blocks", type=int, nargs=2, default=[4096, 16384],
                   help="two per-worker pool sizes, in blocks")
    p.add_argument("--utilization", type=float, default=0.8,
                   help="sets --rate: two workers this busy without any cache")
    p.add_argument("--rate", type=float, default=None, help="prefill tokens per simulated second per worker")
    p.add_argument("--variants", action="store_true",
                   help="also least-loaded vs cache-aware on every trace variant (bench/trace_variants.py)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# -- the scaled trace ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt: list[int]


def load_trace(path: Path | list[TraceRow], n: int, tokens_per_id: int, seed: int) -> list[TraceRequest]:
    """The first `n` requests of the trace file (or of already read rows), as token prompts."""
    blocks: dict[int, list[int]] = {}

    def block(hid: int) -> list[int]:
        if hid not in blocks:  # fixed per id: shared ids give shared token prefixes
            rng = random.Random(seed * 1_000_003 + hid)
            blocks[hid] = [rng.randrange(1000, 150_000) for _ in range(tokens_per_id)]
        return blocks[hid]

    out = []
    for row in (read_rows(path, n) if isinstance(path, Path) else path[:n]):
        ids = row.hash_ids
        tail = row.input_length - TRACE_BLOCK * (len(ids) - 1)  # tokens in the last trace block
        prompt: list[int] = []
        for i, hid in enumerate(ids):
            take = tokens_per_id if i < len(ids) - 1 else max(1, math.ceil(tail * tokens_per_id / TRACE_BLOCK))
            prompt += block(hid)[:take]
        out.append(TraceRequest(row.timestamp_ms / 1000.0, prompt))
    return out


def root_hash(block_size: int) -> bytes:
    """The root every worker and the router share (one model revision and tokenizer)."""
    return CacheKeyRoot("bench-revision", "bench-tokenizer", "bfloat16", block_size, 1).root_hash()


# -- workers ---------------------------------------------------------------------------------------


class IndexSink:
    """The publisher's kvstore side, applied to an in-process index (the bench has no gRPC)."""

    def __init__(self, index: InMemoryBlockIndex) -> None:
        self.index = index

    def publish(self, events: list[BlockEvent]) -> int:
        for e in events:
            (self.index.stored if e.kind == "stored" else self.index.removed)(e.worker, e.tier, e.hashes)
        return len(events)

    def remove_worker(self, worker: str) -> int:
        return self.index.remove_worker(worker)

    def health(self) -> KVStoreHealth:
        return KVStoreHealth("memory", True, "in process", index_epoch="in-process")  # never lost


@dataclass
class SimWorker:
    """One prefill worker: a real block pool and cache manager, modelled compute."""

    name: str
    kv: KVCacheManager
    publisher: KVEventPublisher
    busy_until: float = 0.0
    finishes: list[float] = field(default_factory=list)  # heap of finish times of queued requests

    @classmethod
    def make(cls, name: str, num_blocks: int, block_size: int, index: InMemoryBlockIndex) -> SimWorker:
        pool = BlockPool(num_blocks)
        publisher = KVEventPublisher(name, IndexSink(index))
        pool.add_listener(publisher)
        return cls(name, KVCacheManager(pool, block_size, root_hash(block_size)), publisher)

    def load(self, now: float) -> int:
        while self.finishes and self.finishes[0] <= now:
            heapq.heappop(self.finishes)
        return len(self.finishes)

    def queued_tokens(self, now: float, rate: float) -> int:
        return int(max(0.0, self.busy_until - now) * rate)

    def prefill(self, rid: int, prompt: list[int], now: float, rate: float) -> tuple[int, float]:
        """Cached prompt tokens and time to first token; the pool ends as the engine leaves it."""
        req = Request(f"r{rid}", prompt, PARAMS)
        self.kv.match_prefix(req)
        hit = req.num_cached_prompt
        if self.kv.ensure(req, len(prompt)):
            req.num_computed = len(prompt)
            self.kv.commit_full_blocks(req)
        self.kv.free(req)
        self.publisher.flush()
        start = max(now, self.busy_until)
        self.busy_until = start + (len(prompt) - hit) / rate
        heapq.heappush(self.finishes, self.busy_until)
        return hit, self.busy_until - now


# -- runs ------------------------------------------------------------------------------------------


@dataclass
class Result:
    hit_tokens: int = 0
    prompt_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens


def replay(trace: list[TraceRequest], workers: int, num_blocks: int, block_size: int, rate: float,
           policy: str) -> Result:
    index = InMemoryBlockIndex()
    sims = [SimWorker.make(f"prefill-{i}", num_blocks, block_size, index) for i in range(workers)]
    routing = PrefillRouting(RoutingConfig(unknown_request_tokens=0))
    root, out = root_hash(block_size), Result()
    for rid, r in enumerate(trace):
        now = r.arrival_s
        if policy == "round-robin":
            sim = sims[rid % workers]
        else:  # "least-loaded" is the same policy told of no hits: load balance alone
            n = reusable_blocks(len(r.prompt), block_size)
            matches = {} if policy == "least-loaded" else index.match(
                block_hashes(root, r.prompt[: n * block_size], block_size))
            candidates = [PrefillCandidate(s.name, s.load(now), s.load(now), s.queued_tokens(now, rate),
                                           matches[s.name].device_blocks if s.name in matches else 0)
                          for s in sims]
            decision = routing.choose(candidates, len(r.prompt), block_size)
            out.reasons[decision.reason] += 1
            sim = next(s for s in sims if s.name == decision.address)
        hit, ttft = sim.prefill(rid, r.prompt, now, rate)
        out.hit_tokens += hit
        out.prompt_tokens += len(r.prompt)
        out.ttfts.append(ttft)
    return out


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


def modelled_rate(trace: list[TraceRequest], workers: int, utilization: float) -> float:
    """Prefill tokens per second per worker that keeps `workers` this busy without any cache."""
    span = max(trace[-1].arrival_s - trace[0].arrival_s, 1.0)
    return sum(len(r.prompt) for r in trace) / span / (workers * utilization)


def variant_rows(args) -> list[list]:
    """least-loaded vs cache-aware on each trace variant, at each cache size; ratios ca / ll."""
    base = read_rows(args.trace, args.requests)
    rows = []
    for name, (rewrite, workers) in VARIANTS.items():
        variant = rewrite(base, args.seed)
        trace = load_trace(variant, len(variant), args.tokens_per_id, args.seed)
        rate = modelled_rate(trace, workers, args.utilization)
        for blocks in args.cache_blocks:
            ll, ca = (replay(trace, workers, blocks, args.block_size, rate, p) for p in ("least-loaded", "cache-aware"))
            mean = statistics.mean(ca.ttfts) / statistics.mean(ll.ttfts)
            tail = p90(ca.ttfts) / p90(ll.ttfts)
            rows.append([name, len(trace), workers, blocks, f"{ll.ratio:.1%}", f"{ca.ratio:.1%}",
                         statistics.mean(ll.ttfts), statistics.mean(ca.ttfts), f"{mean:.2f}",
                         p90(ll.ttfts), p90(ca.ttfts), f"{tail:.2f}",
                         "yes" if mean < 1 and tail < 1 and ca.ratio >= ll.ratio else "no"])
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    monitor = RunMonitor()
    trace = load_trace(args.trace, args.requests, args.tokens_per_id, args.seed)
    total = sum(len(r.prompt) for r in trace)
    rate = args.rate or modelled_rate(trace, 2, args.utilization)
    # The ideal: one cache that never evicts and sees every request (compute rate irrelevant).
    unbounded = sum(-(-len(r.prompt) // args.block_size) for r in trace)
    ideal = replay(trace, 1, unbounded, args.block_size, rate, "round-robin").ratio
    rows = []
    for blocks in args.cache_blocks:
        for policy in ("round-robin", "least-loaded", "cache-aware"):
            res = replay(trace, 2, blocks, args.block_size, rate, policy)
            decided = sum(res.reasons.values())
            reasons = ", ".join(f"{k} {v / decided:.0%}" for k, v in sorted(res.reasons.items())) or "-"
            rows.append([blocks, policy, f"{res.ratio:.1%}", f"{res.ratio / ideal:.0%}",
                         statistics.mean(res.ttfts), p90(res.ttfts), reasons])
    command = "python bench/bench_trace_replay.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print_header("Trace replay: prefix-cache hit ratio and cache-aware routing", command.strip())
    print(f"- trace: {args.trace.name}, first {len(trace)} requests, {args.tokens_per_id} tokens per 512-token "
          f"id, block size {args.block_size}, {total:,} prompt tokens")
    print(f"- 2 prefill workers; modelled prefill rate {rate:,.0f} tokens/s per worker "
          f"({args.utilization:.0%} busy without cache); engine-level (real block pools, hashes, "
          "index, policy; no model forward)")
    print(f"- ideal hit ratio (one unbounded cache): {ideal:.1%}")
    print(f"- run: {monitor.summary()}\n")
    print(markdown_table(["cache blocks / worker", "routing", "hit ratio", "of ideal", "TTFT mean (s)",
                          "TTFT p90 (s)", "decisions"], rows))
    if args.variants:
        print("\nTrace variants: least-loaded (ll) vs cache-aware (ca), modelled rate set per variant for "
              f"{args.utilization:.0%} busy workers without cache; ca/ll < 1 is cache-aware faster\n")
        print(markdown_table(["variant", "requests", "workers", "cache blocks / worker", "hit ll", "hit ca",
                              "TTFT mean ll (s)", "TTFT mean ca (s)", "mean ca/ll", "TTFT p90 ll (s)",
                              "TTFT p90 ca (s)", "p90 ca/ll", "ca wins"], variant_rows(args)))


if __name__ == "__main__":
    main()
