"""Prompts that arrive together at one engine: how many prompt tokens they may share a step with.

One engine per setting (`--shared`, the engines' `max_shared_prompt_tokens`; the workers'
`--shared-prompt-tokens`), as a prefill worker runs it (step budget 2,048, MTP auto). Each round,
on every engine in turn: `--prompts` cold `--prompt-tokens`-token prompts join at once and run until
each has its first token. Reported per setting: the prompts' mean and last time to first token and
the steps, against the largest setting within each round. Sharing a step saves the step's fixed work;
each prompt that joins delays the first tokens of those already in it by its own compute.

    python bench/bench_prompt_burst.py [--shared 256,512,100000 --prompts 8 --prompt-tokens 64,256,512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import mean, median

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_floor import random_prompt  # noqa: E402
from bench.common import RunMonitor, int_list, markdown_table, print_header, setup  # noqa: E402
from glmserve.core.generation import SamplingParams  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.model.dtype_choice import resolve_dtype  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--dtype", default="auto", help="auto (the CPU's fast dtype), float32 or bfloat16")
    p.add_argument("--shared", type=int_list, default=[256, 512, 100_000],
                   help="prompt tokens prompts may share a step with (100000: all that fit the budget)")
    p.add_argument("--prompts", type=int, default=8, help="prompts arriving at once")
    p.add_argument("--prompt-tokens", type=int_list, default=[64, 256, 512])
    p.add_argument("--step-tokens", type=int, default=2048, help="the engines' step budget (a prefill worker's)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="a worker's share of a 2-core machine")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def burst(engine: Engine, prompts: list[list[int]], tag: str) -> tuple[list[float], int]:
    """Seconds from the prompts' arrival to each one's first token, and the engine steps taken."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    reqs = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    firsts: dict[int, float] = {}
    steps = 0
    while len(firsts) < len(reqs):
        engine.step()
        steps += 1
        now = time.perf_counter() - start
        firsts.update({i: now for i, r in enumerate(reqs) if r.output_ids and i not in firsts})
    while engine.has_unfinished():  # max_tokens=1: already finished; nothing is left behind
        engine.step()
    return [firsts[i] for i in range(len(reqs))], steps


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    model = load_model(args.model, dtype=resolve_dtype(args.dtype))
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    engines = {s: Engine(model, EngineConfig(prefix_caching=False, max_step_tokens=args.step_tokens,
                                             max_shared_prompt_tokens=s)) for s in args.shared}
    rows = []
    for length in args.prompt_tokens:
        for engine in engines.values():  # warm-up: kernels for every step shape
            burst(engine, [random_prompt(length, vocab, gen) for _ in range(args.prompts)], f"warm-{length}")
        runs: dict[int, list[tuple[list[float], int]]] = {s: [] for s in engines}
        for r in range(args.rounds):
            prompts = [random_prompt(length, vocab, gen) for _ in range(args.prompts)]  # the same for every setting
            for s, engine in engines.items():
                runs[s].append(burst(engine, prompts, f"{length}-{r}"))
        ref = max(engines)
        for s in engines:
            mean_ratio = median(mean(runs[s][r][0]) / mean(runs[ref][r][0]) for r in range(args.rounds))
            last_ratio = median(max(runs[s][r][0]) / max(runs[ref][r][0]) for r in range(args.rounds))
            rows.append([length, s, f"{median(mean(t) for t, _ in runs[s]) * 1e3:.0f}",
                         f"{median(max(t) for t, _ in runs[s]) * 1e3:.0f}", runs[s][0][1],
                         f"{mean_ratio:.2f}x", f"{last_ratio:.2f}x"])
        print(f"{length} tokens done", file=sys.stderr)
    print_header("Prompts arriving together: the prompt tokens they may share a step with",
                 " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]),
                 monitor)
    print(f"- model: `{args.model}`, dtype {model.dtype}, MTP auto, prefix caching off, step budget "
          f"{args.step_tokens}; {args.prompts} cold prompts at once; {args.rounds} rounds, settings in turn "
          f"(medians; ratios within a round, against {max(engines)})\n")
    print(markdown_table(["prompt tokens", "shared prompt tokens", "mean TTFT ms", "last TTFT ms", "steps",
                          "mean x", "last x"], rows))


if __name__ == "__main__":
    main()
