"""Multi-head latent attention (MLA) over the paged latent cache, restricted to the DSA top-k.

The cache keeps, per token, the normalised latent (kv_lora_rank) and the rotated rope key. Two
kernels compute the same function:
- expanded: kv_b_proj turns the context latents into per-head keys and values (cheap for long queries);
- absorbed: kv_b_proj is folded into the query and output, so attention reads latents directly and
  never materialises per-token K/V for the whole context (decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmserve.model.config import GlmConfig
from glmserve.model.forward_batch import SequenceSlice
from glmserve.model.forward_context import ForwardContext
from glmserve.model.indexer import Indexer, causal_mask
from glmserve.model.norms import RMSNorm
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.rope import apply_rope

# Queries per sequence up to which the absorbed kernel is used by default (decode and MTP verify).
ABSORBED_MAX_QUERIES = 16


class MLAttention(nn.Module):
    def __init__(self, config: GlmConfig, layer_idx: int, has_indexer: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.latent_dim = config.v_head_dim, config.kv_lora_rank
        self.scaling = config.qk_head_dim**-0.5
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.latent_dim + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.latent_dim)
        self.kv_b_proj = nn.Linear(self.latent_dim, self.heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, config.hidden_size, bias=False)
        self.indexer = Indexer(config) if has_indexer else None

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, topk_in: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Attention output [N, hidden] and the top-k positions each sequence's queries used.

        `topk_in` (one [S, k] tensor per sequence) reuses another layer's selection; without it the
        layer's own indexer selects.
        """
        n = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(n, self.heads, -1)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rot = apply_rope(q_rot, ctx.cos, ctx.sin)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], dim=-1)
        new_kv = torch.cat([self.kv_a_layernorm(latent), apply_rope(k_rot, ctx.cos, ctx.sin)], dim=-1)
        if ctx.cache is not None:
            ctx.cache.write(ctx.cache.latent_view(self.layer_idx), ctx.batch.slots, new_kv)
        if self.indexer is not None:
            # The indexer learns only from its own distillation loss (DSA), never from the LM loss.
            x_ix, q_resid_ix = x.detach(), q_resid.detach()
            new_keys = self.indexer.keys(x_ix, ctx.cos, ctx.sin)
            if ctx.cache is not None:
                ctx.cache.write(ctx.cache.index_key_view(self.layer_idx), ctx.batch.slots, new_keys)
            if topk_in is None:
                iq, iw = self.indexer.queries(q_resid_ix, x_ix, ctx.cos, ctx.sin)
        elif topk_in is None:
            raise ValueError(f"layer {self.layer_idx}: a shared-indexer layer needs the top-k of a full layer")

        outputs, topks = [], []
        for i, seq in enumerate(ctx.batch.seqs):
            sl = slice(seq.start, seq.end)
            positions = ctx.batch.positions[sl]
            kv = self._context(ctx, seq, new_kv, self.layer_idx, "latent")
            if topk_in is not None:
                topk = topk_in[i]
                index_scores = None
            else:
                keys = self._context(ctx, seq, new_keys, self.layer_idx, "index")
                index_scores = self.indexer.scores(iq[sl], iw[sl], keys, positions)
                topk = self.indexer.select(index_scores)
            selected = None if ctx.dense_attention else topk
            absorbed = ctx.force_absorbed if ctx.force_absorbed is not None else seq.num_new <= ABSORBED_MAX_QUERIES
            attend = self._attend_absorbed if absorbed else self._attend_expanded
            out, probs = attend(q_nope[sl], q_rot[sl], kv, positions, selected, want_probs=ctx.collect_indexer)
            if ctx.collect_indexer and index_scores is not None:
                ctx.indexer_records.append((self.layer_idx, index_scores, probs))
            outputs.append(out)
            topks.append(topk)
        return self.o_proj(torch.cat(outputs, dim=0)), topks

    @staticmethod
    def _context(ctx: ForwardContext, seq: SequenceSlice, new: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """All of a sequence's context rows (cached and new) for this layer."""
        if ctx.cache is None:
            if seq.num_cached:
                raise ValueError("num_cached: a forward without a cache cannot continue a sequence")
            return new[seq.start : seq.end]
        view = ctx.cache.latent_view(layer) if kind == "latent" else ctx.cache.index_key_view(layer)
        return PagedKVCache.gather(view, seq.block_table, seq.context_len)

    def _allowed(self, positions: torch.Tensor, context_len: int, selected: torch.Tensor | None) -> torch.Tensor:
        """[S, T] bool: causal, and within the top-k when a selection applies."""
        allowed = causal_mask(positions, context_len)
        if selected is not None and selected.shape[-1] < context_len:
            chosen = torch.zeros_like(allowed).scatter_(1, selected, True)
            allowed = allowed & chosen
        return allowed

    def _softmax(self, scores: torch.Tensor, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)

    def _attend_expanded(self, q_nope, q_rot, kv, positions, selected, want_probs=False):
        t = kv.shape[0]
        latent, k_rot = kv.split([self.latent_dim, self.rope_dim], dim=-1)
        k_nope, v = self.kv_b_proj(latent).view(t, self.heads, -1).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.unsqueeze(1).expand(t, self.heads, self.rope_dim)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        scores = torch.einsum("shd,thd->hst", q, k) * self.scaling
        probs = self._softmax(scores, self._allowed(positions, t, selected).unsqueeze(0), q.dtype)
        out = torch.einsum("hst,thd->shd", probs, v).reshape(q.shape[0], -1)
        return out, (probs.float().sum(0) if want_probs else None)

    def _attend_absorbed(self, q_nope, q_rot, kv, positions, selected, want_probs=False):
        t = kv.shape[0]
        w = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_dim, self.latent_dim)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_lat = torch.einsum("shd,hdc->shc", q_nope, w_uk)
        if selected is not None and selected.shape[-1] < t and not want_probs:
            rows = kv[selected]  # [S, k, latent + rope]: only the chosen tokens are read
            allowed = (selected <= positions[:, None]).unsqueeze(1)
            latent, k_rot = rows.split([self.latent_dim, self.rope_dim], dim=-1)
            scores = torch.einsum("shc,skc->shk", q_lat, latent) + torch.einsum("shr,skr->shk", q_rot, k_rot)
            probs = self._softmax(scores * self.scaling, allowed, q_lat.dtype)
            lat_out = torch.einsum("shk,skc->shc", probs, latent)
        else:
            latent, k_rot = kv.split([self.latent_dim, self.rope_dim], dim=-1)
            scores = torch.einsum("shc,tc->sht", q_lat, latent) + torch.einsum("shr,tr->sht", q_rot, k_rot)
            allowed = self._allowed(positions, t, selected).unsqueeze(1)
            probs = self._softmax(scores * self.scaling, allowed, q_lat.dtype)
            lat_out = torch.einsum("sht,tc->shc", probs, latent)
        out = torch.einsum("shc,hvc->shv", lat_out, w_uv).reshape(q_nope.shape[0], -1)
        return out, (probs.float().sum(1) if want_probs else None)
