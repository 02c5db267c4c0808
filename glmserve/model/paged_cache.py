"""PagedKVCache: the tensor that holds KV blocks, addressed through a KVLayout.

The cache only stores and gathers; which block belongs to whom is the block pool's business.
"""

from __future__ import annotations

import math

import torch

from glmserve.model.huge_pages import zeros_on_huge_pages
from glmserve.model.kv_layout import KVLayout, Region


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        # One row per block: a block is one contiguous region (one transfer descriptor).
        self.buffer = zeros_on_huge_pages(num_blocks, layout.values_per_block, layout.dtype, device)

    def _view(self, region: Region) -> torch.Tensor:
        size = self.layout.block_size * region.width
        block = self.buffer[:, region.offset : region.offset + size]
        return block.view(self.num_blocks, self.layout.block_size, region.width)

    def latent_view(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] view of one layer."""
        return self._view(self.layout.latent[layer])

    def index_key_view(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, index_head_dim] view of one full-indexer layer."""
        return self._view(self.layout.index_keys[layer])

    @staticmethod
    def write(view: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store one row per token; `slots` are block_id * block_size + offset."""
        block_size = view.shape[1]
        PagedKVCache.write_at(view, (slots // block_size, slots % block_size), values)

    @staticmethod
    def write_at(view: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], values: torch.Tensor) -> None:
        """write() given (block ids, offsets) of the slots, which every layer of a pass shares."""
        view[rows] = values.to(view.dtype)

    @staticmethod
    def gather(view: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """The first `length` tokens of a sequence, in order: [length, width]."""
        block_size = view.shape[1]
        n_blocks = (length + block_size - 1) // block_size
        return PagedKVCache.gather_blocks(view, block_table[:n_blocks]).view(-1, view.shape[2])[:length]

    @staticmethod
    def gather_blocks(view: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Whole blocks [*blocks.shape, block_size, width], copied block by block."""
        # index_select over [num_blocks, block_size * width] rows copies each block with one memcpy;
        # advanced indexing of the strided 3-D view copies element by element (10x slower on CPU).
        rows = view.flatten(1).index_select(0, blocks.reshape(-1))
        return rows.view(*blocks.shape, view.shape[1], view.shape[2])

    @staticmethod
    def gather_rows(view: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows [*blocks.shape, width] of tokens (blocks[i], offsets[i]); only those rows are read."""
        return PagedKVCache.rows_at(view, PagedKVCache.row_index(view, blocks, offsets))

    @staticmethod
    def row_index(view: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Where tokens (blocks[i], offsets[i]) are among the rows `rows_at` reads: the same in every
        layer's view of one region kind (those views differ only in where they start), so one index
        serves every layer's gather of those tokens."""
        step = PagedKVCache._window_step(view)
        return blocks * (view.stride(0) // step) + offsets * (view.stride(1) // step)

    @staticmethod
    def rows_at(view: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows [*index.shape, width] of the tokens at `row_index` `index`, each copied with one memcpy."""
        return PagedKVCache.windows(view).index_select(0, index.reshape(-1)).view(*index.shape, view.shape[2])

    @staticmethod
    def windows(view: torch.Tensor) -> torch.Tensor:
        """An overlapping [M, width] view of the storage from the view's first row on, one row starting
        every `_window_step` values: `row_index` counts in these rows. Gathering its rows copies each
        with one memcpy, where advanced indexing of the strided 3-D view copies element by element
        (10x slower on CPU)."""
        width, step = view.shape[2], PagedKVCache._window_step(view)
        total = view.untyped_storage().nbytes() // view.element_size() - view.storage_offset()
        return view.as_strided(((total - width) // step + 1, width), (step, 1))

    @staticmethod
    def _window_step(view: torch.Tensor) -> int:
        return math.gcd(view.stride(0), view.stride(1))
