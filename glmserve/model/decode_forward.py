"""decode_forward: the whole model over B sequences of S new tokens each, in one function.

Decode (S = 1) and MTP verification (S = k + 1) give every sequence the same few queries, so the whole
pass is batched tensor ops: no Python per sequence, no decode groups, per-sequence top-k lists or
module calls per layer, routed experts run densely, the new tokens' cache addresses computed once.
On the bundled model, where a decode step is per-op overhead, that is 0.7-0.9x the time of the same
step through the layers (`GlmForCausalLM.forward`; bench/bench_decode_choices.py).

It computes what the layers compute, op for op where the result could differ (the same fused and
folded weights, gathers, indexer scores and top-k rule, softmax and dtypes), so decode and
verification steps agree with each other and with `forward` to float rounding; attention reads only
the selected rows (all of them while the context is within index_topk), through the block tables.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmserve.model.config import GlmConfig
from glmserve.model.graph_weights import GraphWeights, LayerWeights, MlpWeights, MoeWeights
from glmserve.model.indexer import causal_mask, top_k_earliest
from glmserve.model.kv_layout import Region
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
    layout = cache.layout
    width = -(-(int(positions[:, -1].max()) + 1) // layout.block_size)  # blocks of the longest context
    tables = tables[:, :width]
    use_index = width * layout.block_size > config.index_topk and int(positions[:, -1].max()) >= config.index_topk
    selected = None if use_index else torch.arange(min(width * layout.block_size, config.index_topk)).expand(b, s, -1)
    slots = tables.gather(1, positions // layout.block_size) * layout.values_per_block
    offsets = (positions % layout.block_size).reshape(-1, 1)
    x = F.embedding(input_ids.reshape(-1), w.embed)
    for layer in w.layers:
        h = _rms(x, layer.input_norm, config.rms_norm_eps)
        fused = F.linear(h, layer.input_proj)
        q_resid = _rms(fused[:, : config.q_lora_rank], layer.q_norm, config.rms_norm_eps)
        kv_a = fused[:, config.q_lora_rank :]
        latent, kv_end = config.kv_lora_rank, config.kv_lora_rank + config.qk_rope_head_dim
        new_kv = torch.cat([_rms(kv_a[:, :latent], layer.kv_norm, config.rms_norm_eps),
                            apply_rope(kv_a[:, latent:kv_end], cos, sin)], dim=-1)
        _store(cache.buffer, layout.latent[layer.index], slots, offsets, new_kv)
        if layer.indexer is not None:
            keys = _index_keys(layer, kv_a[:, kv_end:], config, cos, sin)
            _store(cache.buffer, layout.index_keys[layer.index], slots, offsets, keys)
            if use_index:
                selected = _select(layer, h, q_resid, config, cache, tables, positions, cos, sin)
        query = F.linear(q_resid, layer.query).view(b * s, config.num_attention_heads, -1)
        query = torch.cat([query[..., :latent], apply_rope(query[..., latent:], cos, sin)], dim=-1)
        lat_out = _attend(query.view(b, s, config.num_attention_heads, -1), cache, layout.latent[layer.index],
                          tables, positions, selected, latent)
        x = x + F.linear(lat_out.reshape(b * s, -1), layer.output)
        h = _rms(x, layer.post_norm, config.rms_norm_eps)
        x = x + (_moe(h, layer.mlp) if isinstance(layer.mlp, MoeWeights) else _mlp(h, layer.mlp))
    return _rms(x, w.norm, config.rms_norm_eps)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as glmserve/model/norms.py computes it."""
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _store(buffer: torch.Tensor, region: Region, slots: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> None:
    """Write each new token's row of `region` (slots: its block's first address, per token)."""
    first = slots.reshape(-1, 1) + region.offset + offsets * region.width
    buffer.view(-1)[first + torch.arange(region.width)] = rows.to(buffer.dtype)


def _region_view(cache: PagedKVCache, region: Region) -> torch.Tensor:
    """[num_blocks, block_size, width] view of one region, as PagedKVCache's layer views."""
    size = cache.layout.block_size * region.width
    return cache.buffer[:, region.offset : region.offset + size].view(cache.num_blocks, cache.layout.block_size, -1)


def _index_keys(layer: LayerWeights, projected: torch.Tensor, config: GlmConfig, cos, sin) -> torch.Tensor:
    """The new tokens' indexer keys, as `Indexer.keys_from`."""
    ix = layer.indexer
    k = F.layer_norm(projected, projected.shape[-1:], ix.k_norm_weight, ix.k_norm_bias, 1e-6)
    return _rotate_front(k, config.qk_rope_head_dim, cos, sin)


def _rotate_front(x: torch.Tensor, rope_dim: int, cos, sin) -> torch.Tensor:
    return torch.cat([apply_rope(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)


def _select(layer: LayerWeights, h, q_resid, config: GlmConfig, cache: PagedKVCache, tables, positions, cos, sin):
    """[B, S, index_topk] positions each query attends, as `MLAttention._group_select` selects them."""
    ix = layer.indexer
    b, s = positions.shape
    heads, dim = config.index_n_heads, config.index_head_dim
    q = _rotate_front(F.linear(q_resid, ix.wq_b).view(b * s, heads, dim), config.qk_rope_head_dim, cos, sin)
    weights = F.linear(h.to(ix.weights_proj.dtype), ix.weights_proj).float() * heads**-0.5
    keys = PagedKVCache.gather_blocks(_region_view(cache, cache.layout.index_keys[layer.index]), tables).view(b, -1, dim)
    keys_t = keys.float().transpose(-1, -2).unsqueeze(-3)  # [B, 1, D, T], as Indexer.scores
    per_head = torch.relu(torch.matmul(q.float().view(b, s, heads, dim), keys_t) * dim**-0.5)  # [B, S, H, T]
    scores = torch.matmul(weights.view(b, s, 1, heads), per_head).squeeze(-2)
    scores = scores.masked_fill(causal_mask(positions, keys.shape[1]).logical_not(), float("-inf"))
    return top_k_earliest(scores.reshape(b * s, -1), config.index_topk).view(b, s, -1)


def _attend(query, cache: PagedKVCache, region: Region, tables, positions, selected, latent: int) -> torch.Tensor:
    """Absorbed attention [B * S, H, latent] of queries [B, S, H, latent + rope] (scaled) over the
    selected positions [B, S, K], as `MLAttention._attend_group`."""
    b, s = positions.shape
    block_size = cache.layout.block_size
    blocks = tables.gather(1, (selected // block_size).reshape(b, -1)).view(selected.shape)
    rows = PagedKVCache.gather_rows(_region_view(cache, region), blocks, selected % block_size).to(query.dtype)
    allowed = selected <= positions.unsqueeze(-1)
    scores = torch.matmul(query, rows.transpose(-1, -2))  # [B, S, H, K]
    scores = scores.masked_fill(~allowed.unsqueeze(2), torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, rows)[..., :latent].reshape(b * s, -1, latent)


def _mlp(h: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate, inplace=True).mul_(up), w.down)


def _moe(h: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """The router, every token through every routed expert (two matmuls over all experts' weights side
    by side; each token's activations weighted by its router weight, 0 for the experts it did not
    choose, so the down projection also sums the experts), and the shared expert: what `MoE` computes."""
    scores = F.linear(h.float(), w.router).sigmoid()
    chosen = (scores + w.bias).topk(w.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, chosen)
    if w.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    routing = torch.zeros_like(scores).scatter_(1, chosen, weights * w.scaling)  # [N, E]
    n, e = routing.shape
    gate, up = F.linear(h, w.experts_gate_up).view(n, e, -1).chunk(2, dim=-1)  # [N, E, I] each
    act = (F.silu(gate).mul_(up).float() * routing.unsqueeze(-1)).to(h.dtype)  # router weights are float32
    return F.linear(act.view(n, -1), w.experts_down) + _mlp(h, w.shared)
