"""DecodeGroup: sequences of one forward pass with the same short query length, attended as one batch.

Decode (1 query), MTP verify (k + 1 queries) and MTP drafting put many sequences with few new tokens
in one pass. Looping over them in Python per layer costs more than the arithmetic on small models, so
such sequences are padded to a common block-table width and attended with batched tensor ops. The
padding is never visible: every padded key lies after each query's position and is masked as causal.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from glmserve.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class DecodeGroup:
    seq_ids: list[int]  # indices into ForwardBatch.seqs
    token_idx: torch.Tensor  # [B * S] rows of the flat batch, sequence by sequence
    positions: torch.Tensor  # [B, S] position of each query
    block_tables: torch.Tensor  # [B, W] block ids; entries past a sequence's own blocks are never attended
    context_lens: list[int]  # per sequence: cached + new tokens
    # token_idx as a slice when the group's tokens are one run of the flat batch (a decode-only step):
    # indexing with it makes views instead of copies.
    token_rows: slice | torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_queries(self) -> int:
        return int(self.positions.shape[1])

    def padded_len(self, block_size: int) -> int:
        return int(self.block_tables.shape[1]) * block_size


def decode_groups(batch: ForwardBatch, max_queries: int, block_size: int) -> list[DecodeGroup]:
    """One group per distinct query length <= `max_queries` (sequences with more stay out)."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, seq in enumerate(batch.seqs):
        if 0 < seq.num_new <= max_queries:
            by_len[seq.num_new].append(i)
    return [_group(batch, ids, block_size) for ids in by_len.values()]


def _group(batch: ForwardBatch, seq_ids: list[int], block_size: int) -> DecodeGroup:
    seqs = [batch.seqs[i] for i in seq_ids]
    # Rows of the batch's padded tables, as wide as the longest context needs (a view when the
    # group is the whole batch); past a sequence's context every key is later than its queries.
    width = max((s.context_len + block_size - 1) // block_size for s in seqs)
    rows = batch.block_tables if len(seqs) == len(batch.seqs) else batch.block_tables[seq_ids]
    tables = rows[:, :width]
    one_run = all(a.end == b.start for a, b in zip(seqs, seqs[1:], strict=False))
    if one_run:
        token_rows: slice | torch.Tensor = slice(seqs[0].start, seqs[-1].end)
        token_idx = torch.arange(seqs[0].start, seqs[-1].end)
    else:
        token_idx = token_rows = torch.cat([torch.arange(s.start, s.end) for s in seqs])
    positions = batch.positions[token_rows].view(len(seqs), -1)
    return DecodeGroup(seq_ids, token_idx, positions, tables, [s.context_len for s in seqs], token_rows)
