"""ForwardBatch: the tokens of one forward pass and where their KV lives.

Tokens of all sequences are flattened into one dimension (no padding). Each sequence contributes
`num_new` tokens that follow `num_cached` tokens already in its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceSlice:
    start: int  # index of this sequence's first new token in the flat batch
    num_new: int
    num_cached: int
    block_table: torch.Tensor  # int64 block ids, covering at least num_cached + num_new tokens

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def context_len(self) -> int:
        return self.num_cached + self.num_new


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, position of each token in its sequence
    slots: torch.Tensor  # [N] int64, block_id * block_size + offset of each token's KV
    seqs: tuple[SequenceSlice, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        num_cached: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> ForwardBatch:
        """Batch of sequences, each given its new tokens, cached length and block table."""
        if not (len(token_ids) == len(num_cached) == len(block_tables)):
            raise ValueError("token_ids: token_ids, num_cached and block_tables must have the same length")
        seqs, ids, positions, slots = [], [], [], []
        start = 0
        for toks, cached, table in zip(token_ids, num_cached, block_tables, strict=True):
            total = cached + len(toks)
            if len(table) * block_size < total:
                raise ValueError(f"block_tables: {len(table)} blocks cannot hold {total} tokens")
            table_t = torch.tensor(table, dtype=torch.int64)
            pos = torch.arange(cached, total, dtype=torch.int64)
            positions.append(pos)
            slots.append(table_t[pos // block_size] * block_size + pos % block_size)
            ids.append(torch.tensor(toks, dtype=torch.int64))
            seqs.append(SequenceSlice(start, len(toks), cached, table_t))
            start += len(toks)
        return cls(torch.cat(ids), torch.cat(positions), torch.cat(slots), tuple(seqs))
