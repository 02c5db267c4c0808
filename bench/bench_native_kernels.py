"""The native kernels (glmserve/model/csrc) against the torch ops they replace, interleaved in one process.

Each row runs the same call twice per round, once with the kernels and once with `native_kernels.get`
answering None (the torch ops, as without a compiler or with GLMSERVE_NATIVE_KERNELS=0), in
alternating order. Three levels: (1) each kernel alone at the bundled model's shapes (the indexer's
selection over one prompt, the decode indexer's scores, the decode attention over the selected rows,
float32 products over bfloat16-held weights, RMSNorm, RoPE); (2) a cold prefill on an idle engine, with
the bundled model as it is and with `index_topk` raised above the prompt (no selection: only RMSNorm
and RoPE differ); (3) a decode step at batch B over C-token contexts.

    python bench/bench_native_kernels.py [--prefill-tokens 512,1536,4096 --decode 8x1536,32x256,32x1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from itertools import cycle
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_floor import DecodeLoad, prefill_once, random_prompt  # noqa: E402
from bench.common import RunMonitor, markdown_table, print_header, setup, time_interleaved  # noqa: E402
from bench.vllm_peer import with_index_topk  # noqa: E402
from glmserve.engine.engine import Engine, EngineConfig  # noqa: E402
from glmserve.model import native_kernels  # noqa: E402
from glmserve.model.attention import attend_rows, selected_rows  # noqa: E402
from glmserve.model.dtype_choice import resolve_dtype  # noqa: E402
from glmserve.model.indexer import Indexer  # noqa: E402
from glmserve.model.loader import load_model  # noqa: E402
from glmserve.model.norms import rms_norm  # noqa: E402
from glmserve.model.packed_linear import PackedLinear  # noqa: E402
from glmserve.model.rope import apply_rope  # noqa: E402

KERNELS = native_kernels.get


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefill-tokens", default="512,1536,4096", help="cold prompts on an idle engine; empty skips")
    p.add_argument("--decode", default="8x1536,32x256,32x1024", help="decode steps, B sequences x C context tokens")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def both_ways(fn: Callable[[], object]) -> dict[str, Callable[[], object]]:
    """fn with the kernels and with the torch ops."""
    def torch_ops():
        native_kernels.get = lambda: None
        try:
            return fn()
        finally:
            native_kernels.get = KERNELS
    return {"native": fn, "torch ops": torch_ops}


def row(work: str, fns: dict[str, Callable[[], object]], rounds: int, scale: float, unit: str) -> list[str]:
    times = time_interleaved(fns, repeats=rounds, min_sample_s=0.05)
    native, ops = times["native"].median * scale, times["torch ops"].median * scale
    return [work, f"{ops:,.1f} {unit}", f"{native:,.1f} {unit}", f"{native / ops:.2f}x", f"{times['native'].spread:.0%}"]


def kernel_rows(config, dtype: torch.dtype, rounds: int, gen: torch.Generator) -> list[list[str]]:
    hidden, rope_dim, heads, k = config.hidden_size, config.qk_rope_head_dim, config.num_attention_heads, config.index_topk
    rows = []
    # The indexer's selection over one 1,536-token prompt (its score products included).
    n, ix = 1536, Indexer(config)
    q, weights = torch.randn(n, ix.n_heads, ix.head_dim, generator=gen), torch.rand(n, ix.n_heads, generator=gen)
    keys, positions = torch.randn(n, ix.head_dim, generator=gen), torch.arange(n)
    rows.append(row(f"indexer selection, {n}-token prompt, top-{k}",
                    both_ways(lambda: ix.select_tiled(q, weights, keys, positions)), rounds, 1e3, "ms"))
    # The decode indexer's scores: 32 sequences of 1,024 tokens, their blocks scattered over a pool.
    batch, block, width = 32, 16, 64
    pool = torch.randn(8 * batch * width, block, ix.head_dim, generator=gen).to(dtype)
    tables = torch.randperm(pool.shape[0], generator=gen)[: batch * width].view(batch, width)
    dq, dw = torch.randn(batch, 1, ix.n_heads, ix.head_dim, generator=gen), torch.rand(batch, 1, ix.n_heads, generator=gen)
    last = torch.full((batch, 1), block * width - 1)
    rows.append(row(f"decode indexer scores, {batch} x {block * width} keys from the paged cache",
                    both_ways(lambda: ix.paged_scores(dq, dw, pool, tables, last)), rounds, 1e3, "ms"))
    # Decode attention: each of the 32 queries over its top-k latent rows of those blocks (cold: a pool
    # of 150 MB at float32).
    row_width, latent = config.kv_lora_rank + rope_dim, config.kv_lora_rank
    rows_pool = torch.randn(pool.shape[0], block, row_width, generator=gen).to(dtype)
    selected = torch.stack([torch.randperm(block * width, generator=gen)[:k] for _ in range(batch)]).view(batch, 1, k)
    located = selected_rows(rows_pool, tables, last, selected, None)
    query = torch.randn(batch, 1, heads, row_width, generator=gen).to(dtype)
    rows.append(row(f"decode attention, {batch} x top-{k} of {block * width} latent rows from the paged cache",
                    both_ways(lambda: attend_rows(query, rows_pool, *located, latent)), rounds, 1e3, "ms"))
    rows += linear_rows(config, rounds, gen)
    for tokens in (32, 1536):
        x, w = torch.randn(tokens, hidden, generator=gen).to(dtype), torch.randn(hidden, generator=gen).to(dtype)
        rows.append(row(f"RMSNorm [{tokens}, {hidden}] {str(dtype)[6:]}", both_ways(lambda x=x, w=w: rms_norm(x, w, 1e-5)),
                        rounds, 1e6, "us"))
    for tokens in (32, 1536):
        x = torch.randn(tokens, heads, rope_dim, generator=gen).to(dtype)
        angles = torch.rand(tokens, rope_dim // 2, generator=gen) * 6.0
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        rows.append(row(f"RoPE [{tokens}, {heads}, {rope_dim}] {str(dtype)[6:]}",
                        both_ways(lambda x=x, cos=cos, sin=sin: apply_rope(x, cos, sin)), rounds, 1e6, "us"))
    return rows


def linear_rows(config, rounds: int, gen: torch.Generator) -> list[list[str]]:
    """PackedLinear on float32 weights that bfloat16 holds: bfloat16 panels (native) against oneDNN's
    float32 layout (the torch ops), each call on the next of enough copies of the weight to exceed the L3,
    as a decode step meets its weights."""
    hidden, experts = config.hidden_size, config.n_routed_experts
    moe_width = 2 * (experts + config.n_shared_experts) * config.moe_intermediate_size
    rows = []
    for out_features, in_features, label in ((moe_width, hidden, "MoE gate_up"), (config.vocab_size, hidden, "LM head")):
        weight = torch.randn(out_features, in_features, generator=gen).bfloat16().float()
        copies = max(2, int(96e6 // weight.nbytes))
        panels = [PackedLinear.of(weight.clone()) for _ in range(copies)]
        onednn = [PackedLinear(p.weight, torch.ops.mkldnn._reorder_linear_weight(p.weight, None)) for p in panels]
        for batch in (8, 32):
            x = torch.randn(batch, in_features, generator=gen)
            fns = {"native": partial(next_call, cycle(panels), x), "torch ops": partial(next_call, cycle(onednn), x)}
            rows.append(row(f"{label} [{batch}, {in_features}] x [{in_features}, {out_features}], cold weights",
                            fns, rounds, 1e6, "us"))
    return rows


def next_call(linears, x: torch.Tensor) -> torch.Tensor:
    return next(linears)(x)


class PromptSource:
    """Cold prefills of fresh random prompts on one engine."""

    def __init__(self, engine: Engine, gen: torch.Generator):
        self.engine, self.gen, self.count = engine, gen, 0

    def prefill(self, n: int) -> float:
        self.count += 1
        vocab = self.engine.model.config.vocab_size
        return prefill_once(self.engine, random_prompt(n, vocab, self.gen), f"p{self.count}")


def prefill_rows(model_dir: Path, dtype: torch.dtype, lengths: list[int], rounds: int, seed: int) -> list[list[str]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        raised = with_index_topk(model_dir, Path(tmp) / "dense", 2 * max(lengths))
        for label, path in (("bundled model", model_dir), ("index_topk raised", raised)):
            engine = Engine(load_model(path, dtype=dtype),
                            EngineConfig(mtp="off", prefix_caching=False, kv_cache_bytes=8 * max(lengths) * 3000))
            prompts = PromptSource(engine, torch.Generator().manual_seed(seed))
            for n in lengths:
                rows.append(row(f"prefill {n} tokens, {label}", both_ways(partial(prompts.prefill, n)), rounds, 1e3, "ms"))
    return rows


def decode_rows(model_dir: Path, dtype: torch.dtype, shapes: list[tuple[int, int]], rounds: int,
                seed: int) -> list[list[str]]:
    model = load_model(model_dir, dtype=dtype)
    rows = []
    for batch, context in shapes:
        engine = Engine(model, EngineConfig(mtp="off", prefix_caching=False, max_num_seqs=max(64, batch),
                                            kv_cache_bytes=batch * 8 * 600 * (context + 400)))
        load = DecodeLoad(engine, batch, context, torch.Generator().manual_seed(seed))
        rows.append(row(f"decode step, batch {batch} x {context} tokens", both_ways(load.step), rounds, 1e3, "ms"))
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    if KERNELS() is None:
        print("skipped: the native kernels did not build here (no C++ compiler or ninja, or GLMSERVE_NATIVE_KERNELS=0)")
        return
    monitor = RunMonitor()
    dtype = resolve_dtype(args.dtype)
    model_dir = Path(args.model)
    config = load_model(model_dir, dtype=dtype).config
    rows = kernel_rows(config, dtype, args.rounds, torch.Generator().manual_seed(args.seed))
    lengths = [int(n) for n in args.prefill_tokens.split(",") if n]
    if lengths:
        rows += prefill_rows(model_dir, dtype, lengths, args.rounds, args.seed)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.decode.split(",") if s]
    rows += decode_rows(model_dir, dtype, shapes, args.rounds, args.seed)
    print_header("Native kernels vs the torch ops they replace",
                 " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]), monitor)
    print(f"- `{args.model}`, {dtype}, {args.threads} thread(s); {args.rounds} rounds, the two ways alternating; "
          "medians; prefill: a cold random prompt on an idle engine in its chunks, MTP and prefix caching off\n")
    print(markdown_table(["work", "torch ops", "native", "native / torch ops", "native spread"], rows))


if __name__ == "__main__":
    main()
