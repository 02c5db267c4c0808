"""Decode and long-prompt prefill against their floor: the same matmuls timed alone in the same run.

The engine runs the bundled model: (1) steady decode steps of `--decode-batch` requests (MTP off,
one token each), (2) a cold `--prefill-tokens`-token prompt prefilled in the engine's chunks
(time to its first token). For each, one profiled run records every GEMM (shape, dtype) it executes,
the indexer's score products included; the floor is those GEMMs replayed alone on fresh operands
with the same threads. Real and floor alternate in every round (interleaved), and the ratio is
taken within a round. `--profile` also prints the top ops of one decode step and of the prefill's
last chunk (the one with the longest context).

    python bench/bench_floor.py [--decode-batch 32 --prefill-tokens 16384 --dtype auto --profile]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import RunMonitor, markdown_table, print_header, setup  # noqa: E402
from bench.gemm_floor import gemm_summary, op_count, record, replay_fn, top_ops, total_flops  # noqa: E402
from glmserve.core.generation import SamplingParams  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.model.dtype_choice import resolve_dtype  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--dtype", default="auto", help="auto (the CPU's fast dtype), float32 or bfloat16")
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=256, help="prompt tokens of each decoding request")
    p.add_argument("--decode-steps", type=int, default=20, help="timed decode steps per round")
    p.add_argument("--prefill-tokens", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="print the top ops of a decode step and a prefill chunk")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def random_prompt(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(16, vocab, (n,), generator=gen).tolist()


class DecodeLoad:
    """`batch` requests in steady decode on one engine; `step()` is one engine step."""

    def __init__(self, engine: Engine, batch: int, context: int, gen: torch.Generator):
        self.engine = engine
        vocab = engine.model.config.vocab_size
        params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"decode-{i}", random_prompt(context, vocab, gen), params)
        while any(r.in_prefill for r in engine.requests.values()) or engine.scheduler.num_waiting:
            engine.step()
        engine.step()  # the first decode step of every request

    def step(self) -> None:
        self.engine.step()


def prefill_once(engine: Engine, prompt: list[int], tag: str, on_step=None) -> float:
    """Seconds until the prompt's first token (each engine step is one chunk); the request is aborted then."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    req = engine.add_request(tag, prompt, params)
    while not req.output_ids:
        (on_step or engine.step)()
    seconds = time.perf_counter() - start
    engine.abort(tag)
    return seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    dtype = resolve_dtype(args.dtype)
    model = load_model(args.model, dtype=dtype)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    tokens_needed = args.decode_batch * (args.decode_context + args.decode_steps * (args.rounds + 2) + 8)
    cache_bytes = 2 * max(tokens_needed, args.prefill_tokens + 64) * 3000
    decode = DecodeLoad(Engine(model, EngineConfig(mtp="off", prefix_caching=False, kv_cache_bytes=cache_bytes,
                                                   max_num_seqs=max(64, args.decode_batch))),
                        args.decode_batch, args.decode_context, gen)
    prefill_engine = Engine(model, EngineConfig(mtp="off", prefix_caching=False, kv_cache_bytes=cache_bytes))
    _, decode_gemms, decode_prof = record(decode.step)
    chunk_profiles = []

    def profiled_step():
        _, gemms, prof = record(prefill_engine.step)
        chunk_profiles.append((gemms, prof))

    prefill_once(prefill_engine, random_prompt(args.prefill_tokens, vocab, gen), "profiled", profiled_step)
    prefill_gemms = [g for gemms, _ in chunk_profiles for g in gemms]
    decode_floor, prefill_floor = replay_fn(decode_gemms), replay_fn(prefill_gemms)
    for _ in range(2):  # warm-up
        decode.step()
        decode_floor()
    prefill_floor()

    times: dict[str, list[float]] = {k: [] for k in ("decode", "decode_floor", "prefill", "prefill_floor")}
    for r in range(args.rounds):
        for name, fn in (("decode", decode.step), ("decode_floor", decode_floor)):
            fn()  # untimed: a sample starts warm, not in the caches the last prefill left
            start = time.perf_counter()
            for _ in range(args.decode_steps):
                fn()
            times[name].append((time.perf_counter() - start) / args.decode_steps)
        prompt = random_prompt(args.prefill_tokens, vocab, gen)
        times["prefill"].append(prefill_once(prefill_engine, prompt, f"timed-{r}"))
        start = time.perf_counter()
        prefill_floor()
        times["prefill_floor"].append(time.perf_counter() - start)
        print(f"round {r + 1} done", file=sys.stderr)

    rows = []
    for name, label, gemms in (("decode", f"decode step, batch {args.decode_batch}", decode_gemms),
                               ("prefill", f"prefill of {args.prefill_tokens} tokens", prefill_gemms)):
        real, floor = median(times[name]), median(times[f"{name}_floor"])
        ratio = median(a / b for a, b in zip(times[name], times[f"{name}_floor"], strict=True))
        spread = (max(times[name]) - min(times[name])) / real
        rows.append([label, f"{real * 1e3:,.1f}", f"{floor * 1e3:,.1f}", f"{ratio:.2f}x", f"{spread:.0%}",
                     f"{total_flops(gemms) / 1e9:.2f}", f"{total_flops(gemms) / floor / 1e9:.0f}", gemm_summary(gemms)])
    print_header("Floor: decode and long-prompt prefill vs their matmuls alone",
                 " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]), monitor)
    print(f"- model: `{args.model}`, dtype {dtype} (`--dtype {args.dtype}`), MTP off, prefix caching off; "
          f"decode: {args.decode_batch} requests with {args.decode_context}-token random prompts, "
          f"{args.decode_steps} steps a sample after one untimed; prefill: cold random prompt, engine chunks of "
          f"{prefill_engine.config.max_step_tokens} tokens, time to first token; {args.rounds} rounds, real "
          f"and floor interleaved (medians; ratio within a round)\n")
    print(markdown_table(["work", "real ms", "floor ms", "real / floor", "real spread", "GEMM GFLOP",
                          "floor GFLOP/s", "GEMMs"], rows))
    if args.profile:
        print(f"\nDecode step, batch {args.decode_batch}: {op_count(decode_prof)} ops from Python; top ops by self CPU time\n")
        print(top_ops(decode_prof))
        gemms, prof = chunk_profiles[-1]
        print(f"\nLast prefill chunk (context {args.prefill_tokens}): {op_count(prof)} ops from Python; "
              "top ops by self CPU time\n")
        print(top_ops(prof))


if __name__ == "__main__":
    main()
