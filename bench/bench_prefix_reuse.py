"""Prefix reuse: time to first token of a long prompt whose prefix is already cached vs uncached.

The prompt is `--tokens` tokens of held-out stdlib source. Cached: an engine first runs the first
`--cached` tokens as their own request (max_tokens 1), then the full prompt, which extends it.
Uncached: a fresh engine runs the full prompt. Both engines use the default chunked-prefill budget
(`max_step_tokens` 2048) and MTP `auto`, a KV pool that holds both requests, and one untimed warm-up
request with unrelated tokens; TTFT is the wall time from `add_request` to the step that returns the
first token. Repeated `--repeats` times on fresh engines; the median is reported.

    python bench/bench_prefix_reuse.py [--tokens 4096 --cached 3584 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import markdown_table, print_header, setup  # noqa: E402
from glmserve.core.generation import SamplingParams  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.model.kv_layout import KVLayout  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402
from glmserve.model.revision import model_revision  # noqa: E402
from glmserve.text.tokenizer import Tokenizer  # noqa: E402
from tools.tiny_corpus import stdlib_texts  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--tokens", type=int, default=4096, help="prompt length")
    p.add_argument("--cached", type=int, default=3584, help="prefix run (and cached) first")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def source_tokens(tokenizer: Tokenizer, n: int) -> list[int]:
    """The first `n` tokens of the held-out stdlib files, concatenated."""
    ids: list[int] = []
    for text in stdlib_texts("heldout"):
        ids += tokenizer.encode(text)
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"--tokens: held-out source has only {len(ids)} tokens")


def ttft(engine: Engine, request_id: str, prompt: list[int]) -> float:
    """Seconds from adding the request to the step that returns its first token (then runs it out)."""
    start = time.perf_counter()
    req = engine.add_request(request_id, prompt, FIRST_TOKEN)
    while not req.output_ids:
        engine.step()
    seconds = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return seconds


def fresh_engine(model, revision: str, tokens: int, warmup: list[int]) -> Engine:
    """Default config, with a KV pool of at least 4x `tokens` (the prefix, the prompt and spare)."""
    default = EngineConfig()
    layout = KVLayout.for_config(model.config, default.block_size, dtype=model.dtype, with_mtp=True)
    kv_bytes = max(default.kv_cache_bytes, 4 * tokens * layout.bytes_per_token)
    engine = Engine(model, EngineConfig(kv_cache_bytes=kv_bytes), revision)
    ttft(engine, "warmup", warmup)
    return engine


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not 0 < args.cached < args.tokens:
        raise ValueError("--cached: must be between 0 and --tokens")
    setup(args.threads, args.seed)
    tokenizer = Tokenizer.from_dir(args.model)
    model, revision = load_model(args.model, dtype=torch.float32), model_revision(args.model)
    ids = source_tokens(tokenizer, args.tokens + 256)
    prompt, warmup = ids[: args.tokens], ids[args.tokens :][::-1]  # warm-up shares no prefix
    uncached, cached, hits = [], [], []
    for i in range(args.repeats):
        engine = fresh_engine(model, revision, args.tokens, warmup)
        uncached.append(ttft(engine, "full", prompt))
        engine = fresh_engine(model, revision, args.tokens, warmup)
        ttft(engine, "prefix", prompt[: args.cached])  # max_tokens 1: its blocks stay cached
        before = engine.stats.cached_prompt_tokens
        s = ttft(engine, "full", prompt)
        cached.append(s)
        hits.append(engine.stats.cached_prompt_tokens - before)
        print(
            f"repeat {i}: uncached {uncached[-1]:.3f} s, cached {s:.3f} s ({hits[-1]} tokens hit)",
            file=sys.stderr,
        )
    base = statistics.median(uncached)
    rows = [
        ["uncached (fresh engine)", f"{base * 1e3:.0f}", "1.00", 0, args.tokens],
        [
            f"first {args.cached} tokens cached",
            f"{statistics.median(cached) * 1e3:.0f}",
            f"{base / statistics.median(cached):.2f}",
            statistics.median(hits),
            args.tokens - statistics.median(hits),
        ],
    ]
    print_header(
        "Prefix reuse: time to first token",
        " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]),
    )
    print(
        f"- model: `{args.model}` (float32); {args.tokens}-token prompt of held-out stdlib source; engine "
        f"defaults (block 64, max_step_tokens 2048, MTP auto); median of {args.repeats} fresh-engine repeats\n"
    )
    print(
        markdown_table(
            ["prompt", "TTFT ms", "speed-up vs uncached", "cached_prompt_tokens", "prompt tokens computed"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
