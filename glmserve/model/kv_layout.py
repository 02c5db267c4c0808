"""KVLayout: where every layer's KV of a token lives inside one paged block.

A block holds `block_size` tokens of *all* layers, so one block is one contiguous region and one NIXL
descriptor. Inside a block, regions follow each other layer by layer:

  for each main layer l:       latent + rotated rope key  [block_size, kv_lora_rank + qk_rope_head_dim]
                               then, on a full-indexer layer, its indexer key [block_size, index_head_dim]
  for each MTP layer (opt.):   latent + rope key, then its indexer key

Shared-indexer layers store no indexer key: they reuse a full layer's top-k. Layer by layer, so that
a contiguous range of layers (a LayerSplit stage) is one contiguous slice of every block: a stage's
own layout (``for_config(..., layers=...)``) is exactly that slice, and its blocks are written into
the whole-model blocks of a decode worker at ``slice_of(layers)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmserve.model.config import GlmConfig

LAYOUT_VERSION = "glmserve-kv-2"
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class Region:
    offset: int  # in elements from the start of a block
    width: int  # values per token


@dataclass(frozen=True)
class KVLayout:
    block_size: int
    dtype: torch.dtype
    latent: dict[int, Region]  # layer -> latent + rope key region
    index_keys: dict[int, Region]  # layer -> indexer key region (full layers and MTP layers only)
    values_per_block: int
    num_main_layers: int

    @classmethod
    def for_config(
        cls, config: GlmConfig, block_size: int = 64, dtype: torch.dtype = torch.bfloat16, with_mtp: bool = True,
        layers: range | None = None,
    ) -> KVLayout:
        """The whole model's layout, or with ``layers`` a LayerSplit stage's (its layers only, plus
        the MTP layer when the stage is the last one and ``with_mtp``)."""
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: {dtype} is not a supported KV dtype")
        n_main = config.num_hidden_layers
        layers = range(n_main) if layers is None else layers
        if not (0 <= layers.start < layers.stop <= n_main) or layers.step != 1:
            raise ValueError(f"layers: {layers} is not a contiguous range inside 0..{n_main}")
        full = {*config.full_indexer_layers}
        latent: dict[int, Region] = {}
        index_keys: dict[int, Region] = {}
        mtp = range(n_main, n_main + config.num_nextn_predict_layers) if with_mtp and layers.stop == n_main else ()
        offset = 0
        for layer in [*layers, *mtp]:
            latent[layer] = Region(offset, config.kv_lora_rank + config.qk_rope_head_dim)
            offset += block_size * latent[layer].width
            if layer in full or layer >= n_main:  # the MTP layer always runs its own indexer
                index_keys[layer] = Region(offset, config.index_head_dim)
                offset += block_size * config.index_head_dim
        return cls(block_size, dtype, latent, index_keys, offset, n_main)

    def slice_of(self, layers: range) -> tuple[int, int]:
        """(offset, length) in bytes of ``layers``' regions inside one block of this layout: where a
        stage holding ``layers`` (with the MTP layer if it is the last one) writes its blocks."""
        if not layers or layers.start not in self.latent or layers.stop - 1 not in self.latent:
            raise ValueError(f"layers: {layers} is not inside this layout's layers")
        first = self.latent[layers.start].offset
        stop = self.values_per_block if layers.stop == self.num_main_layers else self.latent[layers.stop].offset
        return first * self.element_bytes, (stop - first) * self.element_bytes

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.values_per_block * self.element_bytes

    @property
    def bytes_per_token(self) -> int:
        """All layers stored in a block (main and, when included, MTP)."""
        return self.bytes_per_block // self.block_size

    @property
    def main_bytes_per_token(self) -> int:
        """Main model only: the number usually quoted for a checkpoint (GLM-5.2 bf16: 95,232)."""
        values = sum(r.width for layer, r in self.latent.items() if layer < self.num_main_layers)
        values += sum(r.width for layer, r in self.index_keys.items() if layer < self.num_main_layers)
        return values * self.element_bytes

    def describe(self) -> str:
        return (
            f"KV layout {LAYOUT_VERSION}: block {self.block_size} tokens, {self.dtype}, "
            f"{self.main_bytes_per_token:,} B/token main model, {self.bytes_per_token:,} B/token stored "
            f"(with MTP), {self.bytes_per_block:,} B/block"
        )
