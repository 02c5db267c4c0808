"""Multi-head latent attention (MLA) over the paged latent cache, restricted to the DSA top-k.

The cache keeps, per token, the normalised latent (kv_lora_rank) and the rotated rope key. The
kernels compute the same function:
- absorbed: kv_b_proj is folded into the query and output, so attention reads latents directly and
  never materialises per-token K/V for the whole context: short queries of many sequences batched
  (DecodeGroup), and prefill over the selected rows only (prefill_attention);
- expanded: kv_b_proj turns the context latents into per-head keys and values: dense prefill while
  the context is within index_topk, and the reference kernels that training and benchmarks ask for
  (`dense_attention`, `collect_indexer`, `force_absorbed`), which mask dense S x T scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmserve.model import native_kernels
from glmserve.model.absorbed_projections import AbsorbedProjections
from glmserve.model.config import GlmConfig
from glmserve.model.decode_group import DecodeGroup
from glmserve.model.forward_batch import SequenceSlice
from glmserve.model.forward_context import ForwardContext
from glmserve.model.fused_linear import FusedLinear
from glmserve.model.indexer import Indexer, causal_mask
from glmserve.model.norms import RMSNorm
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.prefill_attention import dense_attention, flat_rows, paged_rows, sparse_latent_attention
from glmserve.model.rope import apply_rope

# Queries per sequence up to which the absorbed kernel is used by default (decode and MTP verify).
ABSORBED_MAX_QUERIES = 16
# Prefill over a context up to this many times the selection runs dense (SDPA, masked to the
# selection): gathering k rows per query costs more than attending to all T keys while T is short
# (512-token prompts of the bundled model: 5.6x the TTFT of dense in bench_vllm_peer). Bundled model,
# bf16, 1 thread, prefill ms at 4 / 16 / 32: 1,024 tokens 266 / 202 / 201, 2,048 tokens 574 / 509 /
# 510, 3,072 tokens (chunks of 2,048) 947 / 928 / 984.
DENSE_MAX_CONTEXT = 16


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
        # The projections that read the layer input, run as one matmul at inference.
        indexer_proj = [self.indexer.wk, self.indexer.weights_proj] if has_indexer else []
        self.input_proj = FusedLinear([self.q_a_proj, self.kv_a_proj_with_mqa, *indexer_proj])
        self.absorbed = AbsorbedProjections(self.q_b_proj, self.kv_b_proj, self.o_proj, self.heads, self.nope_dim,
                                            self.rope_dim, self.v_dim, self.latent_dim, self.scaling)

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, topk_in: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Attention output [N, hidden] and the top-k positions each sequence's queries used (ascending,
        except where a prefill attended densely: only the set counts there).

        `topk_in` (one [S, k] tensor per sequence) reuses another layer's selection; without it the
        layer's own indexer selects.
        """
        n = x.shape[0]
        if self.indexer is None and topk_in is None:
            raise ValueError(f"layer {self.layer_idx}: a shared-indexer layer needs the top-k of a full layer")
        fused = self.input_proj(x)
        if fused is None:  # training or mixed dtypes: the layers one by one
            fused = [self.q_a_proj(x), self.kv_a_proj_with_mqa(x)]
            if self.indexer is not None:
                # The indexer learns only from its own distillation loss (DSA), never from the LM loss.
                x_ix = x.detach()
                fused += [self.indexer.wk(x_ix), self.indexer.weights_proj(x_ix.to(self.indexer.weights_proj.weight.dtype))]
        q_resid = self.q_a_layernorm(fused[0])
        new_kv, new_keys = self._store_kv(fused[1], fused[2] if self.indexer is not None else None, ctx)
        index = None
        if self.indexer is not None and topk_in is None and self._needs_index(ctx):
            index = (*self.indexer.queries_from(q_resid.detach(), fused[3], ctx.cos, ctx.sin), new_keys)

        topks: list[torch.Tensor] = [None] * len(ctx.batch.seqs)  # type: ignore[list-item]
        grouped_out = []
        for g in self._decode_groups(ctx):
            rows = g.token_rows
            g_index = None if index is None else (index[0][rows], index[1][rows])
            g_topk_in = None if topk_in is None else [topk_in[i] for i in g.seq_ids]
            query = self.absorbed.query(q_resid[rows], ctx.cos[rows], ctx.sin[rows])
            lat_out, g_topks = self._attend_group(ctx, g, query, g_index, g_topk_in)
            grouped_out.append((rows, self.absorbed.output(lat_out)))
            for i, t in zip(g.seq_ids, g_topks, strict=True):
                topks[i] = t
        ungrouped = [i for i, t in enumerate(topks) if t is None]
        if not ungrouped and len(grouped_out) == 1 and grouped_out[0][1].shape[0] == n:
            return grouped_out[0][1], topks  # a decode-only step: one group holds every row, in order
        if ungrouped:
            out = self.o_proj(self._attend_ungrouped(ctx, ungrouped, q_resid, new_kv, index, topk_in, topks))
        else:
            out = x.new_empty(n, self.o_proj.out_features)
        for rows, g_out in grouped_out:
            out[rows] = g_out
        return out, topks

    def _attend_ungrouped(self, ctx, seq_ids, q_resid, new_kv, index, topk_in, topks) -> torch.Tensor:
        """Attention values [N, heads * v_dim] of the sequences outside decode groups (the others'
        rows are zero); their top-k go into `topks`."""
        n = q_resid.shape[0]
        q = self.q_b_proj(q_resid).view(n, self.heads, -1)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rot = apply_rope(q_rot, ctx.cos, ctx.sin)
        out = q_resid.new_zeros(n, self.heads * self.v_dim)
        for i in seq_ids:
            seq = ctx.batch.seqs[i]
            sl = slice(seq.start, seq.end)
            seq_index = None if index is None else (index[0][sl], index[1][sl], index[2])
            seq_topk = None if topk_in is None else topk_in[i]
            out[sl], topks[i] = self._attend_sequence(ctx, seq, q_nope[sl], q_rot[sl], new_kv, seq_index, seq_topk)
        return out

    def write_kv(self, x: torch.Tensor, ctx: ForwardContext) -> None:
        """Only store the KV of the batch's tokens (latent + rotated rope key, and indexer keys when
        this layer has an indexer): enough for tokens no query is asked of."""
        self._store_kv(self.kv_a_proj_with_mqa(x), None if self.indexer is None else self.indexer.wk(x.detach()), ctx)

    def _store_kv(self, kv_a: torch.Tensor, index_k: torch.Tensor | None, ctx: ForwardContext):
        """(new KV rows, new indexer keys or None) from the input's projections, stored in the cache
        when there is one."""
        latent, k_rot = kv_a.split([self.latent_dim, self.rope_dim], dim=-1)
        new_kv = torch.cat([self.kv_a_layernorm(latent), apply_rope(k_rot, ctx.cos, ctx.sin)], dim=-1)
        if ctx.cache is not None:
            ctx.cache.write_at(ctx.cache.latent_view(self.layer_idx), ctx.cache_rows(), new_kv)
        if index_k is None:
            return new_kv, None
        new_keys = self.indexer.keys_from(index_k, ctx.cos, ctx.sin)
        if ctx.cache is not None:
            ctx.cache.write_at(ctx.cache.index_key_view(self.layer_idx), ctx.cache_rows(), new_keys)
        return new_kv, new_keys

    def _needs_index(self, ctx: ForwardContext) -> bool:
        """Whether the indexer's queries are needed: some context is longer than index_topk (shorter
        ones select all of it), or a reference kernel or the indexer's training asks for its scores."""
        if ctx.collect_indexer or ctx.dense_attention or ctx.force_absorbed is not None:
            return True
        return max(seq.context_len for seq in ctx.batch.seqs) > self.indexer.index_topk

    def _decode_groups(self, ctx: ForwardContext) -> list[DecodeGroup]:
        """Groups of short-query sequences for the batched absorbed kernel ([] when it does not apply)."""
        if ctx.cache is None or ctx.dense_attention or ctx.collect_indexer or ctx.force_absorbed is False:
            return []
        return ctx.decode_groups(ABSORBED_MAX_QUERIES)

    def _attend_sequence(self, ctx, seq, q_nope, q_rot, new_kv, index, topk_in):
        """One sequence's attention output [S, heads * v_dim] and top-k."""
        if ctx.collect_indexer or ctx.dense_attention or ctx.force_absorbed is not None:
            return self._attend_reference(ctx, seq, q_nope, q_rot, new_kv, index, topk_in)
        positions = ctx.batch.positions[seq.start : seq.end]
        if topk_in is not None:
            topk = topk_in
        elif index is None:  # the whole context is within index_topk
            topk = torch.arange(seq.context_len).expand(seq.num_new, seq.context_len)
        else:
            iq, iw, new_keys = index
            keys = self._context(ctx, seq, new_keys, self.layer_idx, "index")
            dense = attends_densely(seq.context_len, min(self.indexer.index_topk, seq.context_len))
            topk = self.indexer.select_tiled(iq, iw, keys, positions, ascending=not dense)  # a mask needs no order
        w = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_dim, self.latent_dim)
        k_sel = topk.shape[-1]
        if attends_densely(seq.context_len, k_sel):
            kv = self._context(ctx, seq, new_kv, self.layer_idx, "latent")
            t = kv.shape[0]
            latent, k_rot = kv.to(q_nope.dtype).split([self.latent_dim, self.rope_dim], dim=-1)
            k_nope, v = self.kv_b_proj(latent).view(t, self.heads, -1).split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_rot.unsqueeze(1).expand(t, self.heads, self.rope_dim)], dim=-1)
            q = torch.cat([q_nope, q_rot], dim=-1)
            mask = None if k_sel >= t else ctx.dense_mask(seq.start, topk, positions, t, q.dtype)
            return dense_attention(q, k, v, positions, self.scaling, mask).reshape(q.shape[0], -1), topk
        if ctx.cache is None:
            rows_of = flat_rows(new_kv[seq.start : seq.end])
        else:
            rows_of = paged_rows(ctx.cache.latent_view(self.layer_idx), seq.block_table, seq.context_len)
        q_lat = torch.einsum("shd,hdc->shc", q_nope, w[:, : self.nope_dim])
        query = torch.cat([q_lat, q_rot], dim=-1).mul_(self.scaling)
        lat_out = sparse_latent_attention(query, rows_of, topk, positions, self.latent_dim)
        return torch.einsum("shc,hvc->shv", lat_out, w[:, self.nope_dim :]).reshape(q_nope.shape[0], -1), topk

    def _attend_reference(self, ctx, seq, q_nope, q_rot, new_kv, index, topk_in):
        """The kernels that mask dense S x T scores (training, kernel comparisons)."""
        positions = ctx.batch.positions[seq.start : seq.end]
        kv = self._context(ctx, seq, new_kv, self.layer_idx, "latent")
        index_scores = None
        if topk_in is not None:
            topk = topk_in
        else:
            iq, iw, new_keys = index
            keys = self._context(ctx, seq, new_keys, self.layer_idx, "index")
            index_scores = self.indexer.scores(iq, iw, keys, positions)
            topk = self.indexer.select(index_scores, positions)
        selected = None if ctx.dense_attention else topk
        absorbed = ctx.force_absorbed if ctx.force_absorbed is not None else seq.num_new <= ABSORBED_MAX_QUERIES
        attend = self._attend_absorbed if absorbed else self._attend_expanded
        out, probs = attend(q_nope, q_rot, kv, positions, selected, want_probs=ctx.collect_indexer)
        if ctx.collect_indexer and index_scores is not None:
            ctx.indexer_records.append((self.layer_idx, index_scores, probs))
        return out, topk

    def _attend_group(self, ctx, g: DecodeGroup, query, index, topk_in):
        """Absorbed sparse attention of a DecodeGroup: latent output [B * S, heads, latent] and
        per-sequence top-k, given the absorbed query [B * S, heads, latent + rope] (scaled).

        Only the selected latent rows are read from the paged cache (looked up through the block table),
        never a sequence's whole context.
        """
        b, s = g.num_seqs, g.num_queries
        block_size = ctx.cache.layout.block_size
        if topk_in is not None:
            selected, valid = pad_topk(topk_in)
            topks = topk_in
        else:
            selected = self._group_select(ctx, g, index, block_size)
            valid = None
            topks = split_topk(selected, self.indexer.index_topk, g.context_lens)
        query = query.view(b, s, self.heads, -1)  # [B, S, H, latent + rope]
        lat_out = attend_selected(query, ctx.cache.latent_view(self.layer_idx), g.block_tables, g.positions,
                                  selected.reshape(b, s, -1), valid, self.latent_dim)
        return lat_out.reshape(b * s, self.heads, self.latent_dim), topks

    def _group_select(self, ctx, g: DecodeGroup, index, block_size: int) -> torch.Tensor:
        """[B, S, K] top-k positions of a group's queries over its padded contexts."""
        padded = g.padded_len(block_size)
        if padded <= self.indexer.index_topk or index is None:  # every context within index_topk
            width = min(padded, self.indexer.index_topk)
            return torch.arange(width).expand(g.num_seqs, g.num_queries, width)
        iq, iw = index
        b, s = g.num_seqs, g.num_queries
        scores = self.indexer.paged_scores(iq.view(b, s, *iq.shape[1:]), iw.view(b, s, -1),
                                           ctx.cache.index_key_view(self.layer_idx), g.block_tables, g.positions)
        return self.indexer.select(scores)

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

    def _attend_expanded(self, q_nope, q_rot, kv, positions, selected, want_probs=False):
        t = kv.shape[0]
        latent, k_rot = kv.split([self.latent_dim, self.rope_dim], dim=-1)
        k_nope, v = self.kv_b_proj(latent).view(t, self.heads, -1).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.unsqueeze(1).expand(t, self.heads, self.rope_dim)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        scores = torch.einsum("shd,thd->hst", q, k) * self.scaling
        probs = masked_softmax(scores, self._allowed(positions, t, selected).unsqueeze(0), q.dtype)
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
            probs = masked_softmax(scores * self.scaling, allowed, q_lat.dtype)
            lat_out = torch.einsum("shk,skc->shc", probs, latent)
        else:
            latent, k_rot = kv.split([self.latent_dim, self.rope_dim], dim=-1)
            scores = torch.einsum("shc,tc->sht", q_lat, latent) + torch.einsum("shr,tr->sht", q_rot, k_rot)
            allowed = self._allowed(positions, t, selected).unsqueeze(1)
            probs = masked_softmax(scores * self.scaling, allowed, q_lat.dtype)
            lat_out = torch.einsum("sht,tc->shc", probs, latent)
        out = torch.einsum("shc,hvc->shv", lat_out, w_uv).reshape(q_nope.shape[0], -1)
        return out, (probs.float().sum(1) if want_probs else None)


def attend_selected(query: torch.Tensor, view: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                    selected: torch.Tensor, valid: torch.Tensor | None, latent_dim: int) -> torch.Tensor:
    """Absorbed attention [B, S, H, latent] of queries [B, S, H, latent + rope] (scaled) at `positions`
    [B, S] over the selected positions [B, S, K] of a layer's latent `view`, through block `tables`
    [B, W]; `valid` [B, S, K] marks padding in the selection (None: none). Only the selected rows are
    read, never a sequence's whole context."""
    return attend_rows(query, view, *selected_rows(view, tables, positions, selected, valid), latent_dim)


def selected_rows(view: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor, selected: torch.Tensor,
                  valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(index, allowed): each selected position's row in the cache (PagedKVCache.row_index, the same
    in every layer's view) and [B, S, 1, K] whether its query may attend it, None where every query
    may attend all its rows (a decode step whose contexts all exceed the selection: no mask to apply
    in each layer). Layers that share a selection share these."""
    b, block_size = tables.shape[0], view.shape[1]
    blocks = tables.gather(1, (selected // block_size).reshape(b, -1)).view(selected.shape)
    allowed = selected <= positions.unsqueeze(-1)
    if valid is not None:
        allowed &= valid
    return PagedKVCache.row_index(view, blocks, selected % block_size), None if allowed.all() else allowed.unsqueeze(2)


def attend_rows(query: torch.Tensor, view: torch.Tensor, index: torch.Tensor, allowed: torch.Tensor | None,
                latent_dim: int) -> torch.Tensor:
    """attend_selected over rows located by `selected_rows`. The native kernel reads the rows in place,
    without their copy (cold in cache: a decode step reads every layer of every sequence), the two
    products, mask and softmax as passes of their own."""
    native = native_kernels.for_tensors(query, view) if query.dtype == view.dtype else None
    if native is not None:
        return native.paged_latent_attention(query.float(), view, index, allowed, latent_dim)
    rows = PagedKVCache.rows_at(view, index).to(query.dtype)
    probs = masked_softmax(torch.matmul(query, rows.transpose(-1, -2)), allowed, query.dtype)
    # The value product runs over the whole rows (rope columns included): slicing them first would copy them.
    return torch.matmul(probs, rows)[..., :latent_dim]


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the last dim in float32 where `allowed` (None: everywhere), in `dtype`."""
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)


def split_topk(selected: torch.Tensor, index_topk: int, context_lens: list[int]) -> list[torch.Tensor]:
    """Each sequence's [S, min(index_topk, context)] part of a group's [B, S, K] selection."""
    if min(index_topk, *context_lens) >= selected.shape[-1]:
        return list(selected.unbind(0))  # nothing to cut: one op instead of one per sequence
    return [t[:, : min(index_topk, n)] for t, n in zip(selected, context_lens, strict=True)]


def attends_densely(context_len: int, k: int) -> bool:
    """Whether a prefill over `context_len` positions selecting `k` attends densely, masked to the
    selection (a short context), rather than over only the selected rows."""
    return context_len <= DENSE_MAX_CONTEXT * k


def pad_topk(topk: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack per-sequence [S, k_i] selections into [B, S, K]; pads (k_i < K) are 0 and marked invalid."""
    width = max(t.shape[-1] for t in topk)
    if all(t.shape[-1] == width for t in topk):
        return torch.stack(topk), None
    padded = torch.zeros(len(topk), topk[0].shape[0], width, dtype=torch.int64)
    valid = torch.zeros(len(topk), topk[0].shape[0], width, dtype=torch.bool)
    for i, t in enumerate(topk):
        padded[i, :, : t.shape[-1]] = t
        valid[i, :, : t.shape[-1]] = True
    return padded, valid
