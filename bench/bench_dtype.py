"""The engine in bfloat16 vs float32 on this CPU: decode steps and a cold prefill, interleaved.

What `--dtype auto` decides (glmserve/model/dtype_choice.py) rests on this: bfloat16 only pays where
the CPU has bf16 instructions (AMX, AVX512-BF16). Both engines load the bundled model; in every round
each dtype runs `--decode-steps` steady decode steps of every batch size in `--batches` (MTP off, one
token each) and one cold `--prefill-tokens`-token prompt (time to its first token); the ratio is taken
within a round.

    python bench/bench_dtype.py [--batches 8,32 --prefill-tokens 2048 --rounds 5 --threads 1]
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

from bench.bench_floor import DecodeLoad, prefill_once, random_prompt  # noqa: E402
from bench.common import RunMonitor, markdown_table, print_header, setup  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.model.dtype_choice import FAST_BF16_FLAGS, auto_dtype, cpu_flags  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--decode-context", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=10)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def engines(model_dir: str, dtype: torch.dtype, batches: list[int], args, gen: torch.Generator):
    """(decode loads by batch size, a prefill engine) of one dtype."""
    model = load_model(model_dir, dtype=dtype)
    bytes_per_token = 3000 * (2 if dtype == torch.float32 else 1)
    decode_tokens = max(batches) * (args.decode_context + args.decode_steps * (args.rounds + 2) + 8)
    loads = {b: DecodeLoad(Engine(model, EngineConfig(mtp="off", prefix_caching=False, max_num_seqs=max(64, b),
                                                      kv_cache_bytes=2 * decode_tokens * bytes_per_token)),
                           b, args.decode_context, gen) for b in batches}
    prefill = Engine(model, EngineConfig(mtp="off", prefix_caching=False,
                                         kv_cache_bytes=2 * (args.prefill_tokens + 64) * bytes_per_token))
    return loads, prefill


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    built = {name: engines(args.model, dtype, batches, args, gen) for name, dtype in DTYPES.items()}
    vocab = built["float32"][1].model.config.vocab_size
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name in (list(DTYPES) if r % 2 == 0 else list(DTYPES)[::-1]):
            loads, prefill = built[name]
            for b, load in loads.items():
                start = time.perf_counter()
                for _ in range(args.decode_steps):
                    load.step()
                times.setdefault((name, f"decode step, batch {b}"), []).append((time.perf_counter() - start) / args.decode_steps)
            prompt = random_prompt(args.prefill_tokens, vocab, gen)
            times.setdefault((name, f"prefill of {args.prefill_tokens} tokens"), []).append(
                prefill_once(prefill, prompt, f"{name}-{r}"))
        print(f"round {r + 1} done", file=sys.stderr)
    rows = []
    for work in dict.fromkeys(w for _, w in times):
        f32, bf16 = times[("float32", work)], times[("bfloat16", work)]
        ratio = median(b / f for b, f in zip(bf16, f32, strict=True))
        rows.append([work, f"{median(f32) * 1e3:,.1f}", f"{median(bf16) * 1e3:,.1f}", f"{ratio:.2f}x"])
    flags = sorted(f for f in FAST_BF16_FLAGS if f in cpu_flags())
    print_header("The engine in bfloat16 vs float32",
                 " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]), monitor)
    print(f"- CPU bf16 flags: {', '.join(flags) or 'none'} (so `--dtype auto` is {auto_dtype()}); "
          f"`{args.model}`, MTP off, prefix caching off; decode: {args.decode_context}-token random prompts, "
          f"{args.decode_steps} steps a sample; prefill: cold random prompt, time to first token; "
          f"{args.rounds} rounds, dtypes in alternating order; medians, ratio within a round\n")
    print(markdown_table(["work", "float32 ms", "bfloat16 ms", "bfloat16 / float32"], rows))


if __name__ == "__main__":
    main()
