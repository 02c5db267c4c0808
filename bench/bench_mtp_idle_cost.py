"""What MTP `auto` costs a decode step while it drafts nothing, step by step against `off`.

Two engines on the same model, one with `mtp=auto` and one with `mtp=off`, each hold `batch`
requests in steady decode (held-out code prompts, eos ignored). Their steps alternate, auto then off,
in the rotating order of bench/common.py, so each pair sees the same machine. An auto step "drafts
nothing" when it neither verified drafts (none were proposed the step before) nor proposed any; its
cost is the median over such pairs of (auto step / off step) - 1. Also reported: the share of auto's
steps that proposed drafts and its tokens per step.

    python bench/bench_mtp_idle_cost.py [--batches 1,8,32 --steps 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_engine_throughput import code_prompts  # noqa: E402
from bench.common import RunMonitor, markdown_table, print_header, rotated, setup  # noqa: E402
from glmserve.core.generation import SamplingParams  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.model.dtype_choice import resolve_dtype  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402
from glmserve.text.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", type=lambda t: [int(v) for v in t.split(",") if v], default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=200, help="timed steps per engine and batch")
    p.add_argument("--warmup-steps", type=int, default=60, help="steps before timing (auto learns its costs)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def drafts_pending(engine: Engine) -> int:
    return sum(len(r.drafts) for r in engine.requests.values())


def decoding_engine(model, mtp: str, prompts: list[list[int]], max_tokens: int) -> Engine:
    engine = Engine(model, EngineConfig(mtp=mtp, prefix_caching=False, max_num_seqs=max(64, len(prompts))))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{mtp}-{i}", p, params)
    while engine.scheduler.num_waiting or any(r.in_prefill for r in engine.requests.values()):
        engine.step()
    return engine


def measure(model, prompts: list[list[int]], steps: int, warmup: int) -> dict:
    # auto emits up to 1 + max_drafts tokens a step: its requests must outlast every timed step (they ran
    # out before, and the empty steps counted as free "drafting nothing" ones)
    max_tokens = (steps + warmup) * (1 + EngineConfig().max_drafts) + 16
    engines = {m: decoding_engine(model, m, prompts, max_tokens) for m in ("auto", "off")}
    for _ in range(warmup):
        for e in engines.values():
            e.step()
    pairs, drafted, tokens = [], 0, 0
    for i in range(steps):
        seconds, quiet = {}, True
        for name in rotated(list(engines), i):
            e = engines[name]
            before, gen_before = drafts_pending(e), e.stats.generated_tokens
            start = time.perf_counter()
            e.step()
            seconds[name] = time.perf_counter() - start
            if name == "auto":
                quiet = before == 0 and drafts_pending(e) == 0
                drafted += drafts_pending(e) > 0
                tokens += e.stats.generated_tokens - gen_before
        pairs.append((seconds["auto"], seconds["off"], quiet))
    quiet_pairs = [(a, o) for a, o, q in pairs if q]
    return {
        "off_ms": median(o for _, o, _ in pairs) * 1e3,
        "auto_quiet_ms": median(a for a, _ in quiet_pairs) * 1e3 if quiet_pairs else float("nan"),
        "cost": median(a / o for a, o in quiet_pairs) - 1 if quiet_pairs else float("nan"),
        "quiet_pairs": len(quiet_pairs),
        "drafted_share": drafted / steps,
        "tokens_per_step": tokens / steps / len(prompts),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    dtype = resolve_dtype(args.dtype)
    model = load_model(args.model, dtype=dtype)
    tokenizer = Tokenizer.from_dir(args.model)
    rows = []
    for b in args.batches:
        m = measure(model, code_prompts(tokenizer, b, 128, 256, args.seed + b), args.steps, args.warmup_steps)
        quiet = m["quiet_pairs"] > 0  # else auto drafted on every step: no idle step to price
        rows.append([b, f"{m['off_ms']:.1f}", f"{m['auto_quiet_ms']:.1f}" if quiet else "-",
                     f"{m['cost']:+.1%}" if quiet else "-", m["quiet_pairs"],
                     f"{m['drafted_share']:.0%}", f"{m['tokens_per_step']:.2f}"])
        print(f"batch {b} done", file=sys.stderr)
    print_header("MTP auto while it drafts nothing vs off, step by step",
                 " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]), monitor)
    print(f"- model: `{args.model}` ({dtype}); held-out code prompts of 128-256 tokens, eos ignored; "
          f"{args.warmup_steps} warm-up steps, then {args.steps} steps of each engine alternating (rotating order)\n")
    print(markdown_table(["batch", "off step ms", "auto step ms (drafting nothing)", "auto cost (median of pairs)",
                          "pairs drafting nothing", "auto steps that drafted", "auto tokens/request/step"], rows))


if __name__ == "__main__":
    main()
