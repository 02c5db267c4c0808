"""A decode worker's step budget: a prompt it prefills itself beside its decoding streams.

One engine per budget (`--budgets`, the decode workers' `--max-step-tokens`), each with `--batch`
requests in steady decode (`--context`-token prompts, MTP as the workers run it). Each round, on
every engine in turn: a sample of plain decode steps, then a cold `--prompt-tokens`-token prompt
joins and runs in steps of at most the budget beside the decoding streams, until its first token.
Reported per budget: the decode step alone, the prompt's time to first token and its steps, and what
the prompt cost the engine beyond the decode steps it ran with (time to first token minus that many
plain decode steps), against the largest budget within each round. A smaller budget delays the
streams less per step; each extra step pays the engine's per-step work again.

    python bench/bench_decode_step_budget.py [--budgets 256,512,1024,2048 --prompt-tokens 1536 --batch 7]
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
from bench.common import RunMonitor, int_list, markdown_table, print_header, setup  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.model.dtype_choice import resolve_dtype  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--dtype", default="auto", help="auto (the CPU's fast dtype), float32 or bfloat16")
    p.add_argument("--budgets", type=int_list, default=[256, 512, 1024, 2048], help="prompt tokens per step")
    p.add_argument("--batch", type=int, default=7, help="requests decoding beside the prompt")
    p.add_argument("--context", type=int, default=1536, help="prompt tokens of each decoding request")
    p.add_argument("--prompt-tokens", type=int, default=1536, help="the prompt the decode worker prefills")
    p.add_argument("--decode-steps", type=int, default=5, help="plain decode steps a sample")
    p.add_argument("--mtp", default="auto", help="the engines' mtp (the workers' default: auto)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="a worker's share of a 2-core machine")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def decode_step_s(load: DecodeLoad, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        load.step()
    return (time.perf_counter() - start) / steps


def prompt_beside(engine: Engine, prompt: list[int], tag: str) -> tuple[float, int]:
    """Seconds and steps until the prompt's first token (`prefill_once`, its steps counted)."""
    steps = 0

    def step() -> None:
        nonlocal steps
        engine.step()
        steps += 1

    return prefill_once(engine, prompt, tag, step), steps


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    model = load_model(args.model, dtype=resolve_dtype(args.dtype))
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    cache_bytes = 4 * (args.batch + 1) * (args.context + args.prompt_tokens + 64 * (args.rounds + 2)) * 3000
    loads = {b: DecodeLoad(Engine(model, EngineConfig(mtp=args.mtp, prefix_caching=False, kv_cache_bytes=cache_bytes,
                                                      max_step_tokens=b)), args.batch, args.context, gen)
             for b in args.budgets}
    for b, load in loads.items():  # warm-up: kernels for every chunk shape
        prompt_beside(load.engine, random_prompt(args.prompt_tokens, vocab, gen), f"warm-{b}")
    step: dict[int, list[float]] = {b: [] for b in loads}
    ttft: dict[int, list[tuple[float, int]]] = {b: [] for b in loads}
    for r in range(args.rounds):
        prompt = random_prompt(args.prompt_tokens, vocab, gen)  # the same prompt for every budget this round
        for b, load in loads.items():
            step[b].append(decode_step_s(load, args.decode_steps))
            ttft[b].append(prompt_beside(load.engine, prompt, f"round-{r}"))
        print(f"round {r + 1} done", file=sys.stderr)

    def cost(b: int, r: int) -> float:  # the prompt's own work: its time less the decode steps it ran with
        seconds, steps = ttft[b][r]
        return seconds - steps * step[b][r]

    ref = max(loads)
    rows = []
    for b in loads:
        ratio = median(cost(b, r) / cost(ref, r) for r in range(args.rounds))
        rows.append([b, f"{median(step[b]) * 1e3:.1f}", f"{median(t for t, _ in ttft[b]) * 1e3:.0f}", ttft[b][0][1],
                     f"{median(cost(b, r) for r in range(args.rounds)) * 1e3:.0f}", f"{ratio:.2f}x"])
    print_header("A decode worker's step budget: a prompt beside its decoding streams",
                 " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]),
                 monitor)
    print(f"- model: `{args.model}`, dtype {model.dtype}, MTP {args.mtp}, prefix caching off; {args.batch} requests "
          f"decoding ({args.context}-token prompts), then a cold {args.prompt_tokens}-token prompt joins; "
          f"{args.rounds} rounds, budgets in turn (medians; ratios within a round)\n")
    print(markdown_table(["prompt tokens a step", "decode step ms", "prompt's TTFT ms", "steps",
                          "prompt's own cost ms", f"cost x budget {ref}"], rows))


if __name__ == "__main__":
    main()
