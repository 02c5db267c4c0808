from pathlib import Path

import torch

from glmserve.model.config import GlmConfig
from glmserve.model.huge_pages import HUGE_PAGE, advise_huge_pages, zeros_on_huge_pages
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache
from tests.model.conftest import BUNDLED_DIR

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_the_buffer_is_zeros_of_its_shape_and_dtype():
    t = zeros_on_huge_pages(3, HUGE_PAGE, torch.bfloat16, "cpu")
    assert t.shape == (3, HUGE_PAGE) and t.dtype == torch.bfloat16
    assert not t.any()


def test_advice_needs_a_whole_huge_page_inside_the_tensor():
    assert not advise_huge_pages(torch.zeros(1024))
    if THP.exists():  # a kernel with THP takes the advice in every mode
        assert advise_huge_pages(torch.empty(3 * HUGE_PAGE, dtype=torch.uint8))


def test_a_kv_cache_of_several_huge_pages_starts_zeroed_and_stores_rows():
    config = GlmConfig.from_pretrained(BUNDLED_DIR)
    layout = KVLayout.for_config(config, block_size=64)
    blocks = 4 * HUGE_PAGE // layout.bytes_per_block + 1
    cache = PagedKVCache(layout, blocks)
    assert cache.buffer.shape == (blocks, layout.values_per_block) and not cache.buffer.any()
    view = cache.latent_view(0)
    PagedKVCache.write(view, torch.tensor([5, blocks * 64 - 1]), torch.ones(2, view.shape[2]))
    assert int(cache.buffer.count_nonzero()) == 2 * view.shape[2]
