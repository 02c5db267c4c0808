"""IndexShare prefill benchmark: a GLM-5.2-like indexer schedule vs the same model with every layer full.

One long prompt is prefilled (in chunks of `--chunk` tokens, each chunk attending to the cached ones)
by a small random model whose layer schedule follows GLM-5.2 (`index_topk_freq` 4,
`index_skip_topk_offset` 3: full layers 0,1,2,6,10 of 12), and by the same weights with every layer
`full` (the shared layers get random indexer weights). Prints the measured speedup beside the one
predicted from FLOP counts: end-to-end (attention, MLP, projections and indexer) and indexer only.

    python bench/bench_indexshare_prefill.py [--tokens 8192 --chunk 2048 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

try:
    from bench.common import (
        RunMonitor,
        markdown_table,
        print_header,
        random_config,
        random_model,
        setup,
        time_interleaved,
    )
except ImportError:  # run as a script: bench/ is on sys.path
    from common import (
        RunMonitor,
        markdown_table,
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="prompt length")
    p.add_argument("--chunk", type=int, default=2048, help="tokens per forward (bounds memory)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--freq", type=int, default=4, help="index_topk_freq")
    p.add_argument("--offset", type=int, default=3, help="index_skip_topk_offset")
    p.add_argument("--topk", type=int, default=256, help="index_topk")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--index-heads", type=int, default=16)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=512, help="length of the untimed warm-up prefill")
    p.add_argument("--repeats", type=int, default=1, help="timed prefills per variant (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.chunk < 1 or args.tokens < 1:
        p.error("--tokens and --chunk must be >= 1")
    return args


def build_configs(args: argparse.Namespace) -> tuple[GlmConfig, GlmConfig]:
    """(GLM-5.2-like schedule, the same model with every indexer full)."""
    scheduled = random_config(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        index_topk=args.topk,
        index_n_heads=args.index_heads,
        index_head_dim=args.index_dim,
        index_topk_freq=args.freq,
        index_skip_topk_offset=args.offset,
    )
    all_full = dataclasses.replace(scheduled, indexer_types=("full",) * scheduled.num_hidden_layers)
    all_full.validate()
    return scheduled, all_full


def build_models(
    scheduled: GlmConfig, all_full: GlmConfig, seed: int
) -> tuple[GlmForCausalLM, GlmForCausalLM]:
    """The scheduled model, and the all-full one with its weights (plus random indexers where it had none)."""
    base = random_model(scheduled, seed)
    full = random_model(all_full, seed + 1)
    missing, unexpected = full.load_state_dict(base.state_dict(), strict=False)
    if unexpected or any(".self_attn.indexer." not in name for name in missing):
        raise RuntimeError(f"weights differ beyond the shared layers' indexers: {missing=} {unexpected=}")
    return base, full


def prefill(model: GlmForCausalLM, cache: PagedKVCache, prompt: list[int], chunk: int) -> torch.Tensor:
    """Prefill `prompt` chunk by chunk (the expanded kernel, as a prefill worker runs it); last logits."""
    table = list(range(cache.num_blocks))
    hidden = None
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            batch = ForwardBatch.build(
                [prompt[start : start + chunk]], [start], [table], cache.layout.block_size
            )
            hidden, _ = model.forward(model.context(batch, cache, force_absorbed=False))
        return model.logits(model.final_norm(hidden[-1:]))


def prefill_flops(config: GlmConfig, tokens: int, chunk: int, causal: bool) -> tuple[float, float]:
    """(total, indexer) multiply-add FLOPs (2 per MAC) of a chunked prefill.

    `causal` False counts what the kernels execute: every chunk scores its S queries against all T
    context tokens (the causal and top-k masks are applied after the dense product). True counts only
    the causal half, S*T/2 for a single chunk. Elementwise work (norms, RoPE, softmax, ReLU, top-k
    selection, MoE routing bookkeeping) is not counted.
    """
    c = config
    h, heads, qk, lat = c.hidden_size, c.num_attention_heads, c.qk_head_dim, c.kv_lora_rank
    total = indexer = 0.0
    for start in range(0, tokens, chunk):
        s = min(chunk, tokens - start)
        t = start + s
        pairs = (start + 1 + t) * s / 2 if causal else s * t
        for layer in range(c.num_hidden_layers):
            f = s * h * c.q_lora_rank + s * c.q_lora_rank * heads * qk  # q_a_proj, q_b_proj
            f += s * h * (lat + c.qk_rope_head_dim)  # kv_a_proj_with_mqa
            f += t * lat * heads * (c.qk_nope_head_dim + c.v_head_dim)  # kv_b_proj over the context
            f += pairs * heads * (qk + c.v_head_dim)  # scores and weighted values
            f += s * heads * c.v_head_dim * h  # o_proj
            if c.mlp_layer_types[layer] == "dense":
                f += s * 3 * h * c.intermediate_size
            else:
                experts = c.num_experts_per_tok + c.n_shared_experts
                f += s * (h * c.n_routed_experts + experts * 3 * h * c.moe_intermediate_size)
            if c.indexer_types[layer] == "full":
                ix = s * h * c.index_head_dim + s * c.q_lora_rank * c.index_n_heads * c.index_head_dim
                ix += s * h * c.index_n_heads  # keys (wk), queries (wq_b), weights_proj
                ix += pairs * c.index_n_heads * (c.index_head_dim + 1)  # q.k per head, weighted head sum
                f += ix
                indexer += 2 * ix
            total += 2 * f
    total += 2 * h * c.vocab_size  # LM head on the last token
    return total, indexer


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup(args.threads, args.seed)
    monitor = RunMonitor()
    scheduled, all_full = build_configs(args)
    models = dict(zip(("schedule", "all full"), build_models(scheduled, all_full, args.seed), strict=True))
    configs = {"schedule": scheduled, "all full": all_full}
    n_blocks = -(-args.tokens // BLOCK_SIZE)
    caches = {
        name: PagedKVCache(KVLayout.for_config(cfg, BLOCK_SIZE, torch.float32, with_mtp=False), n_blocks)
        for name, cfg in configs.items()
    }
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, scheduled.vocab_size, (args.tokens,), generator=gen).tolist()
    warm = prompt[: min(args.warmup_tokens, args.tokens)]

    for name, model in models.items():  # warm-up on a short prompt: a full one costs minutes
        prefill(model, caches[name], warm, args.chunk)
    runs = {
        name: (lambda m=m, c=caches[name]: prefill(m, c, prompt, args.chunk)) for name, m in models.items()
    }
    timings = time_interleaved(runs, warmup=0, repeats=args.repeats)

    print_header(
        "IndexShare prefill", "python bench/bench_indexshare_prefill.py " + " ".join(sys.argv[1:]), monitor
    )
    print(
        f"- model: {scheduled.num_hidden_layers} layers, hidden {scheduled.hidden_size}, "
        f"{scheduled.num_attention_heads} heads, kv_lora {scheduled.kv_lora_rank}, indexer "
        f"{scheduled.index_n_heads} heads x {scheduled.index_head_dim}, index_topk {scheduled.index_topk}; "
        f"prompt {args.tokens} tokens in chunks of {args.chunk}; float32; "
        f"median of {args.repeats} after a {len(warm)}-token warm-up\n"
    )
    rows, flops = [], {}
    for name, cfg in configs.items():
        flops[name] = {c: prefill_flops(cfg, args.tokens, args.chunk, c) for c in (False, True)}
        total, ix = flops[name][False]
        full_layers = ",".join(str(i) for i in cfg.full_indexer_layers)
        t = timings[name]
        rows.append(
            [
                name,
                full_layers,
                f"{t.median:.2f}",
                f"{t.spread:.0%}",
                f"{args.tokens / t.median:,.0f}",
                f"{total / 1e9:,.0f}",
                f"{ix / 1e9:,.0f}",
                f"{ix / total:.0%}",
            ]
        )
    print(
        markdown_table(
            [
                "variant",
                "full indexer layers",
                "prefill s",
                "spread",
                "tok/s",
                "GFLOP",
                "indexer GFLOP",
                "indexer share",
            ],
            rows,
        )
    )
    measured = timings["all full"].median / timings["schedule"].median
    pred = flops["all full"][False][0] / flops["schedule"][False][0]
    pred_causal = flops["all full"][True][0] / flops["schedule"][True][0]
    ix_ratio = flops["all full"][False][1] / flops["schedule"][False][1]
    print()
    print(
        markdown_table(
            [
                "speedup of the schedule over all-full",
                "measured",
                "predicted (executed FLOPs)",
                "predicted (causal S*T/2 FLOPs)",
                "indexer-only FLOP ratio",
            ],
            [["end to end", f"{measured:.2f}x", f"{pred:.2f}x", f"{pred_causal:.2f}x", f"{ix_ratio:.2f}x"]],
        )
    )


if __name__ == "__main__":
    main()
