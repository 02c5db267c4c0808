"""KVLayout: a LayerSplit stage's layout is one contiguous slice of the whole model's block."""

from __future__ import annotations

import pytest
import torch
from test_config import GLM52

from glmserve.model.config import GlmConfig
from glmserve.model.kv_layout import KVLayout


@pytest.mark.parametrize("with_mtp", [True, False])
def test_stage_layouts_are_contiguous_slices_of_the_whole_block(with_mtp):
    config = GlmConfig.from_dict(GLM52)
    whole = KVLayout.for_config(config, 64, torch.bfloat16, with_mtp=with_mtp)
    covered = 0
    for layers in (range(0, 3), range(3, 42), range(42, 78)):
        stage = KVLayout.for_config(config, 64, torch.bfloat16, with_mtp=with_mtp, layers=layers)
        offset, length = whole.slice_of(layers)
        assert offset == covered and length == stage.bytes_per_block
        covered += length
        base = offset // whole.element_bytes
        for layer, region in stage.latent.items():  # same regions, shifted by the slice's offset
            assert whole.latent[layer].offset == base + region.offset
        for layer, region in stage.index_keys.items():
            assert whole.index_keys[layer].offset == base + region.offset
        assert set(stage.index_keys) == {i for i in whole.index_keys if i in layers or (i >= 78 and 77 in layers)}
    assert covered == whole.bytes_per_block


def test_layer_by_layer_order_and_sizes():
    config = GlmConfig.from_dict(GLM52)
    layout = KVLayout.for_config(config, 64, torch.bfloat16)
    assert layout.main_bytes_per_token == 95_232  # unchanged by the order
    assert layout.index_keys[0].offset == layout.latent[0].offset + 64 * 576  # layer 0's key follows its latent
    assert layout.latent[4].offset == layout.latent[3].offset + 64 * 576  # shared layer 3 has no key
    with pytest.raises(ValueError, match="layers"):
        KVLayout.for_config(config, 64, torch.bfloat16, layers=range(70, 79))
    with pytest.raises(ValueError, match="layers"):
        KVLayout.for_config(config, 64, torch.bfloat16, layers=range(0, 3)).slice_of(range(3, 5))
