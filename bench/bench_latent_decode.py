"""Latent (absorbed) vs expanded MLA decode: time and memory of one decode step over a paged cache.

The cache is filled with random latents, rope keys and indexer keys through the layout's views (what a
prefill would have written; the step only reads them), then each sequence of the batch decodes one
token with `force_absorbed` True (attention over the latents, kv_b_proj folded into query and output)
and False (kv_b_proj expands every context latent into per-head K and V). The attention shapes are
GLM-5.2's (kv_lora_rank 512, qk_nope 192, qk_rope 64, v 256); each context is run dense (index_topk
above the context) and sparse (index_topk 2048, where the absorbed kernel gathers only those rows).

    python bench/bench_latent_decode.py [--contexts 4096,16384 --batches 1,4 ...]
"""

from __future__ import annotations

import argparse
import sys

import torch

try:
    from bench.common import (
        MiB,
        RunMonitor,
        int_list,
        markdown_table,
        peak_alloc_bytes,
        print_header,
        random_config,
        random_model,
        setup,
        time_interleaved,
    )
except ImportError:  # run as a script: bench/ is on sys.path
    from common import (
        MiB,
        RunMonitor,
        int_list,
        markdown_table,
        peak_alloc_bytes,
        print_header,
        random_config,
        random_model,
        setup,
        time_interleaved,
    )

from glmserve.model.config import GlmConfig
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache

BLOCK_SIZE = 64
DENSE_TOPK = 2**30  # above any context: the indexer selects everything and attention is dense


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int_list, default=[4096, 16384], help="cached tokens per sequence")
    p.add_argument("--batches", type=int_list, default=[1, 4], help="sequences per decode step")
    p.add_argument("--sparse-topk", type=int, default=2048, help="index_topk of the sparse rows")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="timed samples per row and kernel (median)")
    p.add_argument(
        "--min-sample", type=float, default=0.25, help="seconds: faster steps repeat within a sample"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def decode_config(args: argparse.Namespace, index_topk: int) -> GlmConfig:
    return random_config(
        num_hidden_layers=args.layers,
        first_k_dense_replace=args.layers,  # dense MLPs: the MLP is not what this measures
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_attention_heads=args.heads,
        q_lora_rank=512,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=index_topk,
        index_topk_freq=1,
    )


def expanded_kv_bytes(config: GlmConfig, context_len: int, element_bytes: int = 4) -> int:
    """Per-head K/V the expanded kernel materialises for one sequence in one layer (sequences and layers
    run one after another, so this is also its peak): kv_b_proj's output [T, H, nope + v] and the
    concatenated key [T, H, nope + rope], alive together."""
    c = config
    per_token_head = (c.qk_nope_head_dim + c.v_head_dim) + (c.qk_nope_head_dim + c.qk_rope_head_dim)
    return context_len * c.num_attention_heads * per_token_head * element_bytes


def filled_cache(
    config: GlmConfig, batch: int, context: int, seed: int
) -> tuple[PagedKVCache, list[list[int]]]:
    """A cache with `batch` sequences of `context` random tokens (room for one more), and their tables."""
    layout = KVLayout.for_config(config, BLOCK_SIZE, torch.float32, with_mtp=False)
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    cache = PagedKVCache(layout, batch * per_seq)
    gen = torch.Generator().manual_seed(seed)
    for layer in range(config.num_hidden_layers):
        cache.latent_view(layer).normal_(generator=gen)
        if layer in layout.index_keys:
            cache.index_key_view(layer).normal_(generator=gen)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    return cache, tables


def decode_step(
    model: GlmForCausalLM, cache: PagedKVCache, batch: ForwardBatch, absorbed: bool
) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward_logits(batch, cache, force_absorbed=absorbed)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    # Same seed and shapes: the dense and sparse models have the same weights.
    variants = {"dense": DENSE_TOPK, f"sparse {args.sparse_topk}": args.sparse_topk}
    models = {name: random_model(decode_config(args, k), args.seed) for name, k in variants.items()}
    config = next(iter(models.values())).config

    rows = []
    for context in args.contexts:
        for n_seqs in args.batches:
            cache, tables = filled_cache(config, n_seqs, context, args.seed)
            tokens = torch.randint(
                0, config.vocab_size, (n_seqs,), generator=torch.Generator().manual_seed(1)
            )
            batch = ForwardBatch.build([[t] for t in tokens.tolist()], [context] * n_seqs, tables, BLOCK_SIZE)
            for name, model in models.items():
                steps = {
                    a: (lambda m=model, c=cache, b=batch, a=a: decode_step(m, c, b, a)) for a in (True, False)
                }
                timings = time_interleaved(steps, args.warmup, args.repeats, args.min_sample)
                times = {a: t.median for a, t in timings.items()}
                fastest = {a: min(t.samples) for a, t in timings.items()}
                peaks = {a: peak_alloc_bytes(step) for a, step in steps.items()}
                mib = {a: ("n/a" if p is None else f"{p / MiB:,.1f}") for a, p in peaks.items()}
                extra = "n/a" if None in peaks.values() else f"{(peaks[False] - peaks[True]) / MiB:,.1f}"
                analytic = expanded_kv_bytes(config, context + 1) / MiB
                rows.append(
                    [
                        context,
                        n_seqs,
                        name,
                        f"{times[True] * 1e3:,.1f}",
                        f"{times[False] * 1e3:,.1f}",
                        f"{times[False] / times[True]:.1f}x",
                        f"{fastest[False] / fastest[True]:.1f}x",
                        mib[True],
                        mib[False],
                        extra,
                        f"{analytic:,.1f}",
                    ]
                )
            del cache

    print_header(
        "Latent (absorbed) vs expanded decode",
        "python bench/bench_latent_decode.py " + " ".join(sys.argv[1:]),
        monitor,
    )
    print(
        f"- model: {config.num_hidden_layers} layer(s), hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads, kv_lora {config.kv_lora_rank}, qk_nope {config.qk_nope_head_dim}, "
        f"qk_rope {config.qk_rope_head_dim}, v {config.v_head_dim}, indexer {config.index_n_heads} x "
        f"{config.index_head_dim}; float32 paged cache, block {BLOCK_SIZE}; one decode step = one new "
        f"token per sequence; ms/step is the median of {args.repeats} samples after {args.warmup} warm-up step(s), a sample "
        f"averaging as many steps as fill {args.min_sample} s; the ratio of fastest samples is the "
        "same ratio from each kernel's best sample, less sensitive to other processes on the machine"
    )
    print(
        "- peak MiB: high-water mark of tensors allocated during one step, above what was live before it "
        "(torch.profiler allocation events replayed in order); extra = expanded peak - absorbed peak; "
        "K/V analytic = kv_b_proj output [T, H, nope+v] + key [T, H, nope+rope] of one sequence in one "
        "layer (sequences and layers run one after another), float32\n"
    )
    print(
        markdown_table(
            [
                "context",
                "batch",
                "attention",
                "absorbed ms",
                "expanded ms",
                "expanded/absorbed",
                "ratio of fastest samples",
                "absorbed peak MiB",
                "expanded peak MiB",
                "extra MiB (measured)",
                "K/V MiB (analytic)",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
