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
`mtp_forward` runs the MTP layer the same way: the drafter's passes, one position or a few per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmserve.model.attention import attend_rows, selected_rows
from glmserve.model.config import GlmConfig
from glmserve.model.graph_weights import GraphWeights, LayerWeights, MlpWeights, MoeWeights, MtpWeights
from glmserve.model.mlp import silu_mul
from glmserve.model.norms import rms_norm
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.rope import apply_rope
from glmserve.model.row_linear import row_linear


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
    step = DecodePass(config, cache, positions, tables, cos, sin)
    x = F.embedding(input_ids.reshape(-1), w.embed)
    for layer in w.layers:
        x = step.layer(layer, x)
    return rms_norm(x, w.norm, config.rms_norm_eps)


def mtp_forward(
    w: MtpWeights,
    embed: torch.Tensor,
    config: GlmConfig,
    cache: PagedKVCache,
    input_ids: torch.Tensor,
    prev_hidden: torch.Tensor,
    positions: torch.Tensor,
    tables: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    selected: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer over B sequences of S positions each, as `MtpLayer.step` computes it: (its output
    [B * S, hidden], the positions [B, S, K] its queries attended). input_ids [B, S] are the tokens
    after `positions`, `prev_hidden` [B * S, hidden] the hidden states at them. `selected` [B, S, K]
    reuses an earlier step's selection instead of the layer's indexer (`index_share_for_mtp_iteration`);
    `valid` [B, S, K] marks its padding (None: none)."""
    eps = config.rms_norm_eps
    tokens = rms_norm(F.embedding(input_ids.reshape(-1), embed), w.enorm, eps)
    x = w.eh_proj(torch.cat([tokens, rms_norm(prev_hidden, w.hnorm, eps)], dim=-1))
    step = DecodePass(config, cache, positions, tables, cos, sin, selected, valid)
    return step.layer(w.layer, x), step.selected


class DecodePass:
    """What the layers of one decode pass share: where the new tokens' cache rows are, the rope tables,
    the current selection (shared layers reuse the last full layer's) and where its rows are."""

    def __init__(self, config: GlmConfig, cache: PagedKVCache, positions: torch.Tensor, tables: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, selected: torch.Tensor | None = None,
                 valid: torch.Tensor | None = None) -> None:
        block_size = cache.layout.block_size
        self.config, self.cache, self.positions, self.cos, self.sin = config, cache, positions, cos, sin
        last = int(positions[:, -1].max())
        self.tables = tables[:, : last // block_size + 1]  # the blocks of the longest context
        # A given selection stays; else full layers select once some context exceeds index_topk.
        self.use_index = selected is None and last >= config.index_topk
        if selected is None:  # every context within index_topk (until a full layer selects): all of it
            width = min(self.tables.shape[1] * block_size, config.index_topk)
            selected = torch.arange(width).expand(*positions.shape, -1)
        self.selected, self.valid = selected, valid
        self.rows = (self.tables.gather(1, positions // block_size).reshape(-1), (positions % block_size).reshape(-1))
        self.located = None  # (selection, its rows, allowed): layers that share a selection share these

    def layer(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """x after one decoder layer; the layer's new KV (and index keys) go to the cache."""
        config, cache, cos, sin = self.config, self.cache, self.cos, self.sin
        b, s = self.positions.shape
        eps, latent = config.rms_norm_eps, config.kv_lora_rank
        kv_end = latent + config.qk_rope_head_dim
        h = rms_norm(x, layer.input_norm, eps)
        fused = layer.input_proj(h)
        q_resid = rms_norm(fused[:, : config.q_lora_rank], layer.q_norm, eps)
        kv_a = fused[:, config.q_lora_rank :]
        new_kv = torch.cat([rms_norm(kv_a[:, :latent], layer.kv_norm, eps), apply_rope(kv_a[:, latent:kv_end], cos, sin)],
                           dim=-1)
        PagedKVCache.write_at(cache.latent_view(layer.index), self.rows, new_kv)
        if layer.indexer is not None:
            keys = layer.indexer.keys_from(kv_a[:, kv_end:], cos, sin)
            PagedKVCache.write_at(cache.index_key_view(layer.index), self.rows, keys)
            if self.use_index:
                self.selected = _select(layer, h, q_resid, cache, self.tables, self.positions, cos, sin)
        query = layer.query(q_resid).view(b, s, config.num_attention_heads, -1)
        query = torch.cat([query[..., :latent], apply_rope(query[..., latent:], cos.view(b, s, -1), sin.view(b, s, -1))],
                          dim=-1)
        view = cache.latent_view(layer.index)
        if self.located is None or self.located[0] is not self.selected:  # a new selection: find its rows once
            self.located = (self.selected, *selected_rows(view, self.tables, self.positions, self.selected, self.valid))
        lat_out = attend_rows(query, view, *self.located[1:], latent)
        x = x + layer.output(lat_out.reshape(b * s, -1))
        h = rms_norm(x, layer.post_norm, eps)
        return x + (_moe(h, layer.mlp) if isinstance(layer.mlp, MoeWeights) else _mlp(h, layer.mlp))


def _select(layer: LayerWeights, h, q_resid, cache: PagedKVCache, tables, positions, cos, sin) -> torch.Tensor:
    """[B, S, index_topk] positions each query attends, as `MLAttention._group_select` selects them."""
    ix = layer.indexer
    b, s = positions.shape
    q, weights = ix.queries_from(q_resid, row_linear(h.to(ix.weights_proj.weight.dtype), ix.weights_proj.weight), cos, sin)
    scores = ix.paged_scores(q.view(b, s, *q.shape[1:]), weights.view(b, s, -1), cache.index_key_view(layer.index),
                             tables, positions)
    return ix.select(scores)


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
