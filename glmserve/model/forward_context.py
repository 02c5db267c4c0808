"""ForwardContext: what every layer of one forward pass shares."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glmserve.model.decode_group import DecodeGroup, decode_groups
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.prefill_attention import selection_mask


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

