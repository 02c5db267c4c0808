"""The tiled prefill kernels (sparse over the selected rows, dense SDPA, tiled top-k) equal the
reference kernels that mask dense S x T scores, across chunk and tile boundaries."""

from __future__ import annotations

import pytest
import torch
from reference import config_dict

import glmserve.model.attention as attention_module
import glmserve.model.indexer as indexer_module
import glmserve.model.prefill_attention as prefill_module
from glmserve.model.config import GlmConfig
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM, init_random
from glmserve.model.indexer import Indexer
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache

BLOCK = 8


def _model(topk: int) -> GlmForCausalLM:
    config = GlmConfig.from_dict(config_dict("glm52_schedule", index_topk=topk))
    model = GlmForCausalLM(config, with_mtp=False)
    init_random(model, std=0.2, generator=torch.Generator().manual_seed(1))
    return model.eval()


def _chunked_logits(model, prompt, chunk, tables, **flags):
    layout = KVLayout.for_config(model.config, block_size=BLOCK, dtype=torch.float32, with_mtp=False)
    cache = PagedKVCache(layout, num_blocks=200)
    out = []
    for start in range(0, len(prompt), chunk):
        batch = ForwardBatch.build([prompt[start : start + chunk]], [start], tables, BLOCK)
        out.append(model.forward_logits(batch, cache, **flags))
    return torch.cat(out)


@pytest.mark.parametrize("dense_max_context", [1, attention_module.DENSE_MAX_CONTEXT])  # sparse kernel; the default
@pytest.mark.parametrize("topk", [16, 48, 400])  # very sparse, sparse, and dense (context within top-k)
@torch.no_grad()
def test_tiled_prefill_equals_masked_dense_reference(monkeypatch, topk, dense_max_context):
    monkeypatch.setattr(attention_module, "DENSE_MAX_CONTEXT", dense_max_context)
    monkeypatch.setattr(prefill_module, "TILE_VALUES", 3000)  # tiles of a few queries
    monkeypatch.setattr(indexer_module, "SELECT_TILE_VALUES", 5000)
    model = _model(topk)
    prompt = torch.randint(2, 320, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    tables = [list(range(199, 150, -1))]  # descending blocks: a wrong table lookup shows
    fast = _chunked_logits(model, prompt, 70, tables)
    reference = _chunked_logits(model, prompt, 70, tables, force_absorbed=False)
    torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4)
    # Uncached (rows from the pass's own tensor), against the same single pass over the cache (rows
    # from the paged cache). Not against `reference`: a pass of 300 tokens rounds its matmuls unlike
    # passes of 70, enough to flip a near-tie at the top-k cut on some CPUs (AVX512, topk 48).
    uncached = model.forward_logits(ForwardBatch.build([prompt], [0], [[0]], block_size=512))
    torch.testing.assert_close(uncached, _chunked_logits(model, prompt, len(prompt), tables), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_tiled_selection_equals_selection_over_all_scores_with_ties(monkeypatch):
    monkeypatch.setattr(indexer_module, "SELECT_TILE_VALUES", 700)
    indexer = Indexer(GlmConfig.from_dict(config_dict("glm52_schedule", index_topk=12, index_n_heads=2)))
    g = torch.Generator().manual_seed(3)
    for cached, new in ((0, 60), (30, 41), (5, 3)):
        t = cached + new
        positions = torch.arange(cached, t)
        # Rounded inputs give exact ties (many scores are exactly 0 after the ReLU).
        q = torch.randn(new, 2, 32, generator=g).round()
        keys = torch.randn(t, 32, generator=g).round()
        w = torch.randn(new, 2, generator=g).abs().round()
        expected = indexer.select(indexer.scores(q, w, keys, positions), positions)
        assert torch.equal(indexer.select_tiled(q, w, keys, positions), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [0, 230])  # the chunk is the whole context; the chunk after a prefix
@torch.no_grad()
def test_causal_dense_attention_equals_masked_softmax(dtype, cached):
    # Equal head sizes: the path that merges two kernel calls by their log-sum-exps runs only then.
    g = torch.Generator().manual_seed(4)
    s, heads, dim = 70, 4, 32
    q, k, v = (torch.randn(n, heads, dim, generator=g).to(dtype) for n in (s, cached + s, cached + s))
    positions = torch.arange(cached, cached + s)
    got = prefill_module.dense_attention(q, k, v, positions, 0.3)
    scores = torch.einsum("she,the->hst", q.float(), k.float()) * 0.3
    scores.masked_fill_(torch.arange(cached + s) > positions[:, None], float("-inf"))
    expected = torch.einsum("hst,the->she", scores.softmax(-1), v.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
