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
    tables: torch.Tensor  # [B, W] int64 block ids of the whole batch, padded with 0
    row: int  # this sequence's row of `tables`
    num_blocks: int  # its own blocks (covering at least num_cached + num_new tokens)

    @property
    def block_table(self) -> torch.Tensor:
        """[num_blocks] int64 block ids (a view of `tables`)."""
        return self.tables[self.row, : self.num_blocks]

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
    block_tables: torch.Tensor  # [B, W] int64, every sequence's block ids padded with 0

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
        """Batch of sequences, each given its new tokens, cached length and block table.

        Built from Python lists with one tensor per field, not a few per sequence: with 32 decoding
        sequences that is ~10 ops instead of ~300 in every step."""
        if not (len(token_ids) == len(num_cached) == len(block_tables)):
            raise ValueError("token_ids: token_ids, num_cached and block_tables must have the same length")
        width = max(map(len, block_tables), default=0)
        tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        ids, positions, slots, seqs = [], [], [], []
        start = 0
        for row, (toks, cached, table) in enumerate(zip(token_ids, num_cached, block_tables, strict=True)):
            total = cached + len(toks)
            if len(table) * block_size < total:
                raise ValueError(f"block_tables: {len(table)} blocks cannot hold {total} tokens")
            ids += toks
            positions += range(cached, total)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
            seqs.append(SequenceSlice(start, len(toks), cached, tables, row, len(table)))
            start += len(toks)
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        return cls(as_tensor(ids), as_tensor(positions), as_tensor(slots), tuple(seqs), tables)
