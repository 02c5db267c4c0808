"""Dense prefill attention in query tiles vs one fused-kernel call per chunk, interleaved.

Dense prefill (contexts within a few times `index_topk`, or every context once `index_topk` is raised
above the prompt, the same dense work as vLLM's) attends with PyTorch's fused SDPA kernel. On the CPU
that kernel computes every masked score (`is_causal` skips nothing), so glmserve calls it tile by tile
(`DENSE_QUERY_TILE` queries, each tile over the keys up to its last query). Two measurements, each
against one call per chunk (the tile as large as the chunk) in the same rounds:
(1) the kernel alone at the bundled model's head sizes, for chunk shapes S queries x T keys;
(2) the engine's time to first token of a cold prompt with `index_topk` raised above it.

    python bench/bench_dense_prefill.py [--shapes 2048x2048,2048x4096 --prompt-tokens 4096 --rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import glmserve.model.prefill_attention as prefill_attention  # noqa: E402
from bench.bench_floor import prefill_once, random_prompt  # noqa: E402
from bench.common import RunMonitor, markdown_table, print_header, setup, time_interleaved  # noqa: E402
from bench.vllm_peer import with_index_topk  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402

ONE_CALL = 1 << 30  # a tile larger than any chunk: one kernel call per chunk, the baseline


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--shapes", default="2048x2048,2048x4096,2048x8192", help="kernel shapes, S queries x T keys")
    p.add_argument("--prompt-tokens", type=int, default=4096, help="engine prefill; 0 skips it")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def with_tile(tile: int, fn):
    def run():
        saved = prefill_attention.DENSE_QUERY_TILE
        prefill_attention.DENSE_QUERY_TILE = tile
        try:
            return fn()
        finally:
            prefill_attention.DENSE_QUERY_TILE = saved
    return run


def kernel_rows(shapes: list[tuple[int, int]], config: dict, rounds: int) -> list[list[str]]:
    heads, v_dim = config["num_attention_heads"], config["v_head_dim"]
    qk_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    rows = []
    for s, t in shapes:
        q, k, v = torch.randn(s, heads, qk_dim), torch.randn(t, heads, qk_dim), torch.randn(t, heads, v_dim)
        positions = torch.arange(t - s, t)
        attend = partial(prefill_attention.dense_attention, q, k, v, positions, qk_dim**-0.5)
        fns = {name: with_tile(tile, attend)
               for name, tile in (("tiles", prefill_attention.DENSE_QUERY_TILE), ("one call", ONE_CALL))}
        tiled, whole = fns["tiles"](), fns["one call"]()
        err = (tiled - whole).abs().max().item()
        times = time_interleaved(fns, repeats=rounds)
        ratio = times["tiles"].median / times["one call"].median
        rows.append([f"{s} x {t}", f"{times['one call'].median * 1e3:,.1f}", f"{times['tiles'].median * 1e3:,.1f}",
                     f"{ratio:.2f}x", f"{times['tiles'].spread:.0%}", f"{err:.1e}"])
    return rows


def engine_row(model_dir: Path, prompt_tokens: int, rounds: int, seed: int) -> list[str]:
    model = load_model(model_dir, dtype=torch.float32)
    engine = Engine(model, EngineConfig(mtp="off", prefix_caching=False, kv_cache_bytes=4 * prompt_tokens * 3000))
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    tags = iter(range(1 << 30))
    fns = {name: with_tile(tile, lambda: prefill_once(engine, random_prompt(prompt_tokens, vocab, gen), f"p{next(tags)}"))
           for name, tile in (("tiles", prefill_attention.DENSE_QUERY_TILE), ("one call", ONE_CALL))}
    times = time_interleaved(fns, repeats=rounds)
    ratio = times["tiles"].median / times["one call"].median
    return [f"engine TTFT, {prompt_tokens}-token prompt, index_topk {model.config.index_topk}",
            f"{times['one call'].median * 1e3:,.0f}", f"{times['tiles'].median * 1e3:,.0f}", f"{ratio:.2f}x",
            f"{times['tiles'].spread:.0%}", ""]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    model_dir = Path(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",") if shape]
    rows = kernel_rows(shapes, config, args.rounds)
    if args.prompt_tokens:
        with tempfile.TemporaryDirectory() as tmp:
            raised = with_index_topk(model_dir, Path(tmp) / "dense", 2 * args.prompt_tokens)
            rows.append(engine_row(raised, args.prompt_tokens, args.rounds, args.seed))
    print_header("Dense prefill attention: query tiles vs one call per chunk",
                 " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]), monitor)
    print(f"- `{args.model}` head sizes, float32, {args.threads} thread(s); tiles of "
          f"{prefill_attention.DENSE_QUERY_TILE} queries; {args.rounds} rounds interleaved, medians; "
          "engine: cold random prompt in the engine's chunks, MTP and prefix caching off\n")
    print(markdown_table(["work", "one call ms", "tiles ms", "tiles / one call", "tiles spread", "max abs diff"], rows))


if __name__ == "__main__":
    main()
