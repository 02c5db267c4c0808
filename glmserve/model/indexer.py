"""DSA lightning indexer: scores every earlier token for each query and keeps the best `index_topk`.

Scores are ReLU(q_h . k) summed over heads with per-token weights from `weights_proj` (kept in fp32),
scaled by n_heads^-0.5 and head_dim^-0.5 (the checkpoint's definition scales each head's product by
head_dim^-0.5 before the ReLU: the same up to float rounding).
Only `full` layers own an indexer; `shared` layers reuse the nearest earlier full layer's selection.
"""

from __future__ import annotations

import torch
from torch import nn

from glmserve.model import native_kernels
from glmserve.model.config import GlmConfig
from glmserve.model.cpu_cache import l2_bytes
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.rope import apply_rope

# Scores per query tile of the prefill selection ([tile, heads, T] fp32 temporaries): a core's L2, where
# they stay between the product, the ReLU and the head sum (1 MiB on an AMD EPYC, where 8 MiB tiles were
# 1.5x slower; with 2 MiB on an AMX Xeon, 2 MiB tiles select 1.07-1.1x faster than 1 MiB ones).
SELECT_TILE_VALUES = l2_bytes() // 4
# Rows of at most this many times k + 1 scores select by a mask at the k-th best instead of sorting the
# top k: 0.57x the time at 32 x 320 scores, k = 128 (a batch-32 decode step's selection); about even at
# 8x, 1.2-1.5x slower beyond (an AMX Xeon).
SHORT_ROW = 4


class Indexer(nn.Module):
    def __init__(self, config: GlmConfig):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.index_topk = config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def _rotate_front(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The indexer keeps its rope dims in front (attention keeps them at the back).
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin), rest], dim=-1)

    def keys_from(self, projected: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Indexer keys of new tokens [N, head_dim] given wk(hidden) (computed together with the other
        projections of the layer input); these go to the cache."""
        return self._rotate_front(self.k_norm(projected), cos, sin)

    def queries_from(
        self, q_resid: torch.Tensor, projected_weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head queries [N, H, D] and head weights [N, H] (fp32) of new tokens, given
        weights_proj(hidden). The weights carry the score scale head_dim^-0.5 too: ReLU(s x) = s ReLU(x)
        for s > 0, and scaling [N, H] weights costs nothing where scaling [N, H, T] products was a pass
        over all of them (4% of a 16K-token prefill)."""
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        q = self._rotate_front(q, cos, sin)
        return q, projected_weights.float() * (self.n_heads**-0.5 * self.head_dim**-0.5)

    def scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor):
        """Index scores [..., S, T] of S queries over T context keys; later tokens are -inf (causal).

        q [..., S, H, D], weights [..., S, H], keys [..., T, D], positions [..., S]; the leading
        dimension, when present, is a batch of sequences.
        """
        keys_t = keys.float().transpose(-1, -2).unsqueeze(-3)  # [..., 1, D, T]
        per_head = torch.relu(torch.matmul(q.float(), keys_t))  # [..., S, H, T]; the scale is in weights
        scores = torch.matmul(weights.unsqueeze(-2), per_head).squeeze(-2)  # [..., S, T]
        later = causal_mask(positions, keys.shape[-2]).logical_not_()
        return scores.masked_fill_(later, float("-inf"))  # in place: `scores` is this call's own

    def paged_scores(self, q: torch.Tensor, weights: torch.Tensor, view: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """scores() [B, S, W * block_size] of B sequences' S queries over the index keys in their blocks:
        q [B, S, H, D], weights [B, S, H], view [num_blocks, block_size, D] (a layer's index keys),
        tables [B, W]. The native kernel reads the keys in place, without the copy, conversion and mask
        of the torch ops (no faster alone, but a batch-32 decode step takes 0.92-0.96x the time without
        their memory traffic); it adds the same terms in another order, so a score may differ in its
        last bits."""
        native = native_kernels.for_tensors(q, weights, view)
        if native is not None:
            return native.paged_index_scores(q.float(), weights.float(), view, tables, positions)
        keys = PagedKVCache.gather_blocks(view, tables).view(tables.shape[0], -1, view.shape[2])
        return self.scores(q, weights, keys, positions)

    def select_tiled(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                     positions: torch.Tensor, ascending: bool = True) -> torch.Tensor:
        """select(scores(q, weights, keys, positions), positions) of one sequence's S queries over its
        T keys, without an [S, T] tensor: query tiles score and select one after another, and the
        causal mask touches only the keys after a tile's first query. `ascending=False` leaves each
        row in no particular order (the same set): a mask built from it needs none, and the sort was
        4% of a 1,536-token prefill."""
        s, t = q.shape[0], keys.shape[0]
        k = min(self.index_topk, t)
        if k == t:
            return torch.arange(k, device=q.device).expand(s, k)
        short = int(torch.searchsorted(positions, k))  # queries before position k select 0..k-1
        out = torch.empty(s, k, dtype=torch.int64, device=q.device)
        out[:short] = torch.arange(k, device=q.device)
        keys_t, q = keys.float().t(), q.float()
        native = native_kernels.for_tensors(keys.detach())  # it returns positions: no gradient to keep
        step = max(1, SELECT_TILE_VALUES // (self.n_heads * t))
        for a in range(short, s, step):
            b = min(a + step, s)
            first, end = int(positions[a]) + 1, int(positions[b - 1]) + 1  # keys from `end` on are all later
            per_head = torch.matmul(q[a:b], keys_t[:, :end]).relu_()  # [tile, H, end], as scores()
            scores = torch.bmm(weights[a:b].float().unsqueeze(1), per_head).squeeze(1)  # [tile, end]
            if native is not None:  # each row searches only its visible keys: no causal mask
                out[a:b] = native.top_k_earliest(scores, positions[a:b] + 1, k, ascending)
                continue
            if first < end:
                later = torch.arange(first, end, device=q.device) > positions[a:b, None]
                scores[:, first:].masked_fill_(later, float("-inf"))
            out[a:b] = top_k_earliest(scores, k, ascending)
        return out

    def select(self, scores: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Top-k token positions [..., S, min(index_topk, T)] (int64, ascending) of each query.

        ReLU makes exact ties common (many scores are exactly 0). Ties at the cut are broken towards
        earlier positions, so the selection never depends on how queries were batched or chunked
        (nor on padding after a sequence's end: padded keys score -inf).
        `positions` [S] (one sequence's ascending query positions) lets queries at positions < k skip
        the search: they see at most k keys, every later one scores -inf, so they select 0..k-1.
        """
        lead, t = scores.shape[:-1], scores.shape[-1]
        k = min(self.index_topk, t)
        if k == t:
            return torch.arange(k, device=scores.device).expand(*lead, k)
        if positions is None or scores.dim() != 2:
            return top_k_earliest(scores.reshape(-1, t), k).view(*lead, k)
        short = int(torch.searchsorted(positions, k))  # queries before position k
        if short == 0:
            return top_k_earliest(scores, k)
        first = torch.arange(k, device=scores.device).expand(short, k)
        if short == lead[0]:
            return first
        return torch.cat([first, top_k_earliest(scores[short:], k)])


def top_k_earliest(flat: torch.Tensor, k: int, ascending: bool = True) -> torch.Tensor:
    """[R, k] positions of each row's k best scores, ties towards earlier positions (k < T); ascending,
    or with `ascending=False` in no particular order (rows with ties at the cut are ascending anyway)."""
    native = native_kernels.for_tensors(flat.detach()) if flat.dtype == torch.float32 else None
    if native is not None:  # the same positions, in one pass per row
        return native.top_k_earliest(flat, torch.full(flat.shape[:1], flat.shape[1], dtype=torch.int64), k, ascending)
    # torch.topk finds the best (2-3x faster than kthvalue on CPU, and on int32 1.5x faster than on
    # float32 on an AMD EPYC). It takes k + 1: a row whose (k+1)-th best equals its k-th has ties at
    # the cut (frequent after the ReLU), and only those rows need the earliest ties picked; the others
    # drop their (k+1)-th. This costs no pass over the whole row beyond topk's own. On long rows it
    # searches only the members of the best groups (`best_group_members`). Short rows (decode over a
    # context within a few times k) skip that bookkeeping: a mask at the k-th best, in position order.
    if flat.shape[-1] <= SHORT_ROW * (k + 1):
        keys = int_keys(flat)
        return earliest_at_cut(keys, keys.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True), k)
    values, where = flat, None
    group = prefilter_group(flat.shape[-1], k)
    if group > 1:
        values, where = best_group_members(flat, k, group)
    top = int_keys(values).topk(k + 1, dim=-1, sorted=False)
    last_two = top.values.topk(2, dim=-1, largest=False)  # each row's (k+1)-th and k-th best
    keep = torch.ones_like(top.indices, dtype=torch.bool).scatter_(1, last_two.indices[:, :1], False)
    chosen = top.indices[keep].view(-1, k)
    out = chosen if where is None else where.gather(1, chosen)
    if ascending:
        out = out.sort(-1).values
    tied_rows = (last_two.values[:, 0] == last_two.values[:, 1]).nonzero()[:, 0]
    if tied_rows.numel():
        out[tied_rows] = earliest_at_cut(int_keys(flat[tied_rows]), last_two.values[tied_rows, 1:], k)
    return out


def earliest_at_cut(keys: torch.Tensor, cut: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k] ascending positions: those above each row's k-th best key `cut` [R, 1], then the earliest
    equal to it."""
    above, tied = keys > cut, keys == cut
    room = k - above.sum(-1, keepdim=True)
    return (above | (tied & (tied.cumsum(-1) <= room))).nonzero()[:, 1].view(-1, k)


def prefilter_group(t: int, k: int) -> int:
    """Positions per group of `best_group_members` for rows of t scores, or 1: no prefilter. A row's
    search then covers about t / g group maxima and (k + 1) g members instead of t scores: 0.43-0.6x the
    time at t / k = 30-130 with 8, 0.87x at 16 with 3 (an AMX Xeon, 8-64 rows of 2-16K scores); below
    t / k ~ 12 it costs more than it saves."""
    ratio = t // (k + 1)
    return min(8, ratio // 4) if ratio >= 12 else 1


def best_group_members(flat: torch.Tensor, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and positions [R, (k + 1) group + tail] that hold each row's k + 1 best values.

    With n = T // group, group j holds positions j, j + n, ..., so its maximum is a vectorised max of
    `group` slices; the rows' positions past n * group (the tail) are always members. The k + 1 groups
    with the highest maxima are taken. Every score above the row's (k+1)-th best w lies in a group whose
    maximum exceeds w, and at most k groups hold one, so all of them are taken; the other groups taken
    either include every group whose maximum is w or all hold a score >= w. Either way the members' k + 1
    best values are the row's: ties at the cut still show, and without them the k best are the row's."""
    rows, t = flat.shape
    n = t // group
    best = flat[:, : n * group].unflatten(1, (group, n)).amax(1).topk(k + 1, dim=-1, sorted=False).indices
    where = (best.unsqueeze(-1) + torch.arange(0, n * group, n, device=flat.device)).flatten(1)
    if n * group < t:
        where = torch.cat([where, torch.arange(n * group, t, device=flat.device).expand(rows, -1)], 1)
    return flat.gather(1, where), where


def int_keys(x: torch.Tensor) -> torch.Tensor:
    return ordered_ints(x) if x.dtype == torch.float32 else x


def ordered_ints(x: torch.Tensor) -> torch.Tensor:
    """int32 keys of float32 values in the same order, equal exactly where the values are equal
    (-0.0 and 0.0 included; no NaN expected): the sign bit set flips the other bits."""
    bits = (x + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    return bits.bitwise_xor_((bits >> 31).bitwise_and_(0x7FFFFFFF))  # in place: no more temporaries


def causal_mask(positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """[..., S, T] bool: key j is visible to the query at position p iff j <= p."""
    return torch.arange(context_len, device=positions.device) <= positions.unsqueeze(-1)
