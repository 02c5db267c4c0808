"""decode_forward: the whole model over B sequences of S new tokens each, in one function.

Decode (S = 1) and MTP verification (S = k + 1) give every sequence the same few queries, so the whole
pass is batched tensor ops: no Python per sequence, no decode groups or per-sequence top-k lists,
routed experts run densely (with the shared expert, one gated MLP), the new tokens' cache rows and
each selection's rows found once. On the bundled model, where a
decode step is per-op overhead, that is 0.7-0.9x the time of the same step through the layers
(`GlmForCausalLM.forward`; bench/bench_decode_choices.py).

It computes what the layers compute, with their pieces where the result could differ (the same fused
and folded weights, the layer's Indexer and router, attention's `attend_rows`, `rms_norm`), so decode and
verification steps agree with each other and with `forward` to float rounding; attention reads only
the selected rows (all of them while the context is within index_topk), through the block tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmserve.model.attention import attend_rows, selected_rows
from glmserve.model.config import GlmConfig
from glmserve.model.graph_weights import GraphWeights, LayerWeights, MlpWeights, MoeWeights
from glmserve.model.mlp import silu_mul
from glmserve.model.norms import rms_norm
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.rope import apply_rope


def decode_forward(
    w: GraphWeights,
    config: GlmConfig,
    cache: PagedKVCache,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    tables: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Normed hidden states [B * S, hidden] (before the LM head) of ids at positions [B, S] (consecutive
    per row) over block tables [B, W] that cover them; the new tokens' KV is stored in `cache`.
    cos / sin: the rope tables of the flattened positions."""
    b, s = positions.shape
    block_size, eps = cache.layout.block_size, config.rms_norm_eps
    last = int(positions[:, -1].max())
    tables = tables[:, : last // block_size + 1]  # the blocks of the longest context
    use_index = last >= config.index_topk  # else every context is within the selection
    selected = None if use_index else torch.arange(min(tables.shape[1] * block_size, config.index_topk)).expand(b, s, -1)
    rows = (tables.gather(1, positions // block_size).reshape(-1), (positions % block_size).reshape(-1))
    latent, kv_end = config.kv_lora_rank, config.kv_lora_rank + config.qk_rope_head_dim
    x = F.embedding(input_ids.reshape(-1), w.embed)
    located = None  # (selection, its rows, allowed): layers that share a selection share where its rows are
    for layer in w.layers:
        h = rms_norm(x, layer.input_norm, eps)
        fused = layer.input_proj(h)
        q_resid = rms_norm(fused[:, : config.q_lora_rank], layer.q_norm, eps)
        kv_a = fused[:, config.q_lora_rank :]
        new_kv = torch.cat([rms_norm(kv_a[:, :latent], layer.kv_norm, eps), apply_rope(kv_a[:, latent:kv_end], cos, sin)],
                           dim=-1)
        PagedKVCache.write_at(cache.latent_view(layer.index), rows, new_kv)
        if layer.indexer is not None:
            keys = layer.indexer.keys_from(kv_a[:, kv_end:], cos, sin)
            PagedKVCache.write_at(cache.index_key_view(layer.index), rows, keys)
            if use_index:
                selected = _select(layer, h, q_resid, cache, tables, positions, cos, sin)
        query = layer.query(q_resid).view(b, s, config.num_attention_heads, -1)
        query = torch.cat([query[..., :latent], apply_rope(query[..., latent:], cos.view(b, s, -1), sin.view(b, s, -1))],
                          dim=-1)
        view = cache.latent_view(layer.index)
        if located is None or located[0] is not selected:  # a new selection: find its rows once
            located = (selected, *selected_rows(view, tables, positions, selected, None))
        lat_out = attend_rows(query, view, *located[1:], latent)
        x = x + layer.output(lat_out.reshape(b * s, -1))
        h = rms_norm(x, layer.post_norm, eps)
        x = x + (_moe(h, layer.mlp) if isinstance(layer.mlp, MoeWeights) else _mlp(h, layer.mlp))
    return rms_norm(x, w.norm, eps)


def _select(layer: LayerWeights, h, q_resid, cache: PagedKVCache, tables, positions, cos, sin) -> torch.Tensor:
    """[B, S, index_topk] positions each query attends, as `MLAttention._group_select` selects them."""
    ix = layer.indexer
    b, s = positions.shape
    q, weights = ix.queries_from(q_resid, ix.weights_proj(h.to(ix.weights_proj.weight.dtype)), cos, sin)
    keys = PagedKVCache.gather_blocks(cache.index_key_view(layer.index), tables).view(b, -1, ix.head_dim)
    return ix.select(ix.scores(q.view(b, s, *q.shape[1:]), weights.view(b, s, -1), keys, positions))


def _mlp(h: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    gate, up = w.gate_up(h).chunk(2, dim=-1)
    return w.down(silu_mul(gate, up))


def _moe(h: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """The router, then every token through every routed expert and the shared expert as one gated MLP
    (two matmuls): each token's routed activations weighted by its router weight, 0 for the experts it
    did not choose, so the down projection sums the experts and the shared one: what `MoE` computes."""
    _, weights, chosen = w.router(h)
    routing = torch.zeros(h.shape[0], w.router.config.n_routed_experts).scatter_(1, chosen, weights)  # [N, E] fp32
    gate, up = w.gate_up(h).chunk(2, dim=-1)
    act = silu_mul(gate, up)  # [N, E * I + I_shared]
    act[:, : w.routed_width].view(*routing.shape, -1).mul_(routing.unsqueeze(-1))  # in float32, rounded once
    return w.down(act)
