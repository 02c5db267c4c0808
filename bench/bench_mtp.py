"""MTP speculative decoding: `auto` (adaptive drafts) and fixed 1, 2, 3 drafts vs `off`, batch 1 and 32.

Prompts: held-out stdlib source (code, 128-256 tokens) and agent chats cut right after an
`<|assistant|>` turn opens (the model writes the turn; up to 512 tokens). Greedy; a request stops at
eos or `--max-tokens`, and since greedy MTP is lossless every configuration generates the same
tokens (`same as off` checks it). Each configuration gets a fresh engine (prefix caching off) and a
warm-up run with other prompts at the same batch size, so `auto` has measured step costs and
acceptance before the timed runs; its counters are reset after the warm-up. The timed runs come in
`--rounds` rounds, each running every configuration once, so drifts of the machine's speed hit all of
them alike; ratios are taken within a round. Batch 1 runs `--b1-requests` requests one after another. `decode tok/s` counts the tokens after every request of
a batch has its first one, over the time since then; `tok/s` is end to end, prefill included.

    python bench/bench_mtp.py [--batches 1,32 --configs off,auto,1,2,3 --max-tokens 64 ...]
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
from glmserve.engine.engine_stats import EngineStats  # noqa: E402
from glmserve.model.dtype_choice import resolve_dtype  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402
from glmserve.model.revision import model_revision  # noqa: E402
from glmserve.text.tokenizer import Tokenizer  # noqa: E402
from tools.tiny_corpus import assistant_spans, chat_transcripts  # noqa: E402


def str_list(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--dtype", default="auto", help="auto (the CPU's fast dtype, what the engine runs), float32 or bfloat16")
    p.add_argument("--batches", type=lambda t: [int(v) for v in str_list(t)], default=[1, 32])
    p.add_argument("--configs", type=str_list, default=["off", "auto", "1", "2", "3"])
    p.add_argument("--kinds", type=str_list, default=["code", "chat"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=32)
    p.add_argument("--b1-requests", type=int, default=4, help="requests timed one by one at batch 1")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument("--rounds", type=int, default=3, help="timed runs per configuration, interleaved")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def chat_prompts(tokenizer: Tokenizer, n: int, seed: int, max_len: int = 512) -> list[list[int]]:
    """`n` agent chats, each cut after the opening of its last assistant turn that fits `max_len`."""
    out: list[list[int]] = []
    for text in chat_transcripts(4 * n, seed):
        cuts = [tokenizer.encode(text[:start]) for start, _ in assistant_spans(text)]
        fitting = [ids for ids in cuts if len(ids) <= max_len]
        if fitting:
            out.append(fitting[-1])
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} chat prompts fit in {max_len} tokens")


def run_batch(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], float, float, int]:
    """Runs the prompts together; returns outputs, total seconds, decode seconds and decode tokens."""
    reqs = [engine.add_request(f"r{engine.stats.steps}-{i}", p, params) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    first_at, tokens_at_first = None, 0
    while engine.has_unfinished():
        engine.step()
        if first_at is None and all(r.output_ids for r in reqs):
            first_at, tokens_at_first = time.perf_counter(), sum(len(r.output_ids) for r in reqs)
    end = time.perf_counter()
    outputs = [r.output_ids for r in reqs]
    return outputs, end - start, end - first_at, sum(map(len, outputs)) - tokens_at_first


def measure(engine: Engine, groups: list[list[list[int]]], params: SamplingParams) -> dict:
    outputs, seconds, decode_s, decode_tokens = [], 0.0, 0.0, 0
    for group in groups:
        out, s, ds, dt = run_batch(engine, group, params)
        outputs += out
        seconds, decode_s, decode_tokens = seconds + s, decode_s + ds, decode_tokens + dt
    tokens = sum(map(len, outputs))
    return {
        "outputs": outputs,
        "tok/s": tokens / seconds,
        "decode tok/s": decode_tokens / decode_s,
        "tokens": tokens,
    }


def _row(kind: str, batch: int, cfg: str, runs: list[dict], base: list[dict], st: EngineStats, n: int) -> list:
    """One table row: medians over rounds, ratios to the baseline's run of the same round."""
    same = sum(o == q for o, q in zip(runs[0]["outputs"], base[0]["outputs"], strict=True)) / n
    ratios = [r["tok/s"] / b["tok/s"] for r, b in zip(runs, base, strict=True)]
    ratio = [median(r[key] / b[key] for r, b in zip(runs, base, strict=True)) for key in ("tok/s", "decode tok/s")]
    return [
        kind,
        batch,
        cfg,
        runs[0]["tokens"],
        f"{median(r['tok/s'] for r in runs):.1f}",
        f"{ratio[0]:.2f}",
        f"{min(ratios):.2f}-{max(ratios):.2f}",
        f"{median(r['decode tok/s'] for r in runs):.1f}",
        f"{ratio[1]:.2f}",
        f"{st.mean_acceptance_length:.2f}",
        f"{st.draft_acceptance_rate:.2f}",
        f"{st.draft_tokens / max(sum(st.acceptance_lengths.values()), 1):.2f}",
        f"{same:.2f}",
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    tokenizer = Tokenizer.from_dir(args.model)
    dtype = resolve_dtype(args.dtype)
    model, revision = load_model(args.model, dtype=dtype), model_revision(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.ignore_eos)
    warm_params = SamplingParams(max_tokens=args.warmup_tokens, temperature=0.0, ignore_eos=True)
    makers = {"code": lambda tok, n, seed: code_prompts(tok, n, 128, 256, seed), "chat": chat_prompts}
    rows = []
    for kind in args.kinds:
        for b in args.batches:
            n = args.b1_requests if b == 1 else b
            prompts = makers[kind](tokenizer, 2 * n, args.seed)
            timed, warm = prompts[:n], prompts[n:]
            groups = [timed[i : i + b] for i in range(0, n, b)]
            engines = {}
            for cfg in args.configs:
                mtp = int(cfg) if cfg.isdigit() else cfg
                engine = Engine(model, EngineConfig(mtp=mtp, prefix_caching=False, max_num_seqs=max(64, b)), revision)
                for i in range(0, n, b):
                    run_batch(engine, warm[i : i + b], warm_params)
                engine.stats = EngineStats()
                engines[cfg] = engine
            # Rounds interleave the configurations, so a slow spell of the machine hits them all alike;
            # each ratio is taken within a round, and the median round is reported.
            results: dict[str, list[dict]] = {cfg: [] for cfg in args.configs}
            for r in range(args.rounds):
                for cfg in rotated(args.configs, r):  # each configuration takes other places in the order
                    results[cfg].append(measure(engines[cfg], groups, params))
            rows += [_row(kind, b, cfg, results[cfg], results[args.configs[0]], engines[cfg].stats, n)
                     for cfg in args.configs]
            print(f"{kind} batch {b} done", file=sys.stderr)
    print_header(
        "MTP speculative decoding",
        " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]),
        monitor,
    )
    print(
        f"- model: `{args.model}`, dtype {dtype} (`--dtype {args.dtype}`); greedy, up to {args.max_tokens} tokens per request"
        f"{' (eos ignored)' if args.ignore_eos else ' (stops at eos)'}; prefix caching off; each configuration "
        f"on its own engine after a warm-up run ({args.warmup_tokens} tokens, other prompts, same batch); "
        f"batch 1 = {args.b1_requests} requests one after another; {args.rounds} timed rounds with the "
        f"configurations interleaved in rotating order: medians, and ratios vs `{args.configs[0]}` within a round (median)\n"
    )
    print(
        markdown_table(
            [
                "prompts",
                "batch",
                "mtp",
                "tokens",
                "tok/s",
                "x off",
                "x off range",
                "decode tok/s",
                "decode x off",
                "mean accept len",
                "draft accept rate",
                "drafts/step",
                "same as off",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
