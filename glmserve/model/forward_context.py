"""ForwardContext: what every layer of one forward pass shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glmserve.model.decode_group import DecodeGroup, decode_groups
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.indexer import causal_mask
from glmserve.model.paged_cache import PagedKVCache


@dataclass
class ForwardContext:
    """One forward pass over a ForwardBatch.

    `cache` None means the batch is self-contained (training, or a reference run): every sequence must
    have num_cached == 0 and attends to its own new tokens only.
    `dense_attention` turns the sparse top-k restriction off (the DSA dense warm-up in training).
    `collect_indexer` asks full-indexer layers to record (index scores, attention probabilities) per
    sequence in `indexer_records`, for the indexer's distillation loss.
    `force_absorbed` chooses the attention kernel (None: absorbed for short queries, expanded otherwise).
    """

    batch: ForwardBatch
    cos: torch.Tensor
    sin: torch.Tensor
    cache: PagedKVCache | None = None
    dense_attention: bool = False
    collect_indexer: bool = False
    force_absorbed: bool | None = None
    indexer_records: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _groups: dict[int, list[DecodeGroup]] = field(default_factory=dict, repr=False)
    _cache_rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _dense_masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def cache_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block id, offset in block) of each new token's KV (computed once per pass, not per layer)."""
        if self._cache_rows is None:
            block_size = self.cache.layout.block_size
            self._cache_rows = (self.batch.slots // block_size, self.batch.slots % block_size)
        return self._cache_rows

    def dense_mask(self, seq: int, selected: torch.Tensor, positions: torch.Tensor, context_len: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [S, T] (0 where a query attends a key, -inf elsewhere) of sequence `seq`'s
        selection `selected` [S, k] within its causal context. Built once per selection: the layers
        that share it (consecutive) share the mask, and only a sequence's latest one is kept. A float
        mask, not a bool one: the fused kernel converted a bool mask in every call (10% of a
        1,536-token prefill)."""
        held = self._dense_masks.get(seq)
        if held is None or held[0] is not selected:
            reuse = None if held is None else held[1]  # the previous selection's layers have run
            held = (selected, selection_mask(selected, positions, context_len, dtype, reuse))
            self._dense_masks[seq] = held
        return held[1]

    def decode_groups(self, max_queries: int) -> list[DecodeGroup]:
        """The batch's DecodeGroups (built once per pass, shared by every layer)."""
        if max_queries not in self._groups:
            self._groups[max_queries] = decode_groups(self.batch, max_queries, self.cache.layout.block_size)
        return self._groups[max_queries]


def selection_mask(selected: torch.Tensor, positions: torch.Tensor, context_len: int, dtype: torch.dtype,
                   reuse: torch.Tensor | None = None) -> torch.Tensor:
    """Additive mask [S, T]: 0 at each query's selected positions [S, k] up to its own, -inf elsewhere,
    written into `reuse` where it has that shape and dtype (a fresh 1,536 x 1,536 tensor costs more in
    page faults than the fill).

    Only queries before position k can have selected a later position (they select 0..k-1); a later
    query's k best scores are all visible ones. So the causal cut touches only those first rows and
    their first k keys, not the whole [S, T]. The selection goes in by flat position (index_fill_:
    4x faster than scatter_ on a 1,536 x 1,536 mask)."""
    s, k = selected.shape
    if reuse is not None and reuse.shape == (s, context_len) and reuse.dtype == dtype:
        mask = reuse.fill_(float("-inf"))
    else:
        mask = torch.full((s, context_len), float("-inf"), dtype=dtype)
    flat = selected + torch.arange(0, s * context_len, context_len, device=selected.device).unsqueeze(1)
    mask.view(-1).index_fill_(0, flat.view(-1), 0.0)
    short = int(torch.searchsorted(positions, k))
    if short:
        mask[:short, :k].masked_fill_(causal_mask(positions[:short], k).logical_not_(), float("-inf"))
    return mask
