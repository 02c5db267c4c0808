"""The batched short-query kernel (DecodeGroup) equals attending each sequence on its own."""

from __future__ import annotations

import pytest
import torch
from reference import config_dict

from glmserve.model.attention import MLAttention
from glmserve.model.config import GlmConfig
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM, init_random
from glmserve.model.indexer import Indexer
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache

BLOCK = 8


def _prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 320, (length,), generator=g).tolist()


def test_gather_rows_and_blocks_read_exactly_the_addressed_rows():
    config = GlmConfig.from_dict(config_dict("glm52_schedule"))
    layout = KVLayout.for_config(config, block_size=BLOCK, dtype=torch.float32, with_mtp=True)
    cache = PagedKVCache(layout, num_blocks=7)
    cache.buffer.copy_(torch.randn_like(cache.buffer))
    blocks = torch.tensor([[6, 0, 3], [2, 2, 5]])
    offsets = torch.tensor([[7, 0, 4], [1, 6, 3]])
    for layer in (0, 3, config.num_hidden_layers):  # first region, middle, MTP region at the end
        for view in (cache.latent_view(layer), cache.index_key_view(layer) if layer != 3 else None):
            if view is None:
                continue
            assert torch.equal(PagedKVCache.gather_rows(view, blocks, offsets), view[blocks, offsets])
            assert torch.equal(PagedKVCache.gather_blocks(view, blocks), view[blocks])


def _prefilled(topk: int, lengths: list[int]):
    """A random model with index_topk `topk` and a cache holding prompts of `lengths` tokens in
    interleaved block tables: (model, cache, tables)."""
    config = GlmConfig.from_dict(config_dict("glm52_schedule", index_topk=topk))
    torch.manual_seed(0)
    model = GlmForCausalLM(config)
    init_random(model, std=0.2, generator=torch.Generator().manual_seed(1))
    model.eval()
    layout = KVLayout.for_config(config, block_size=BLOCK, dtype=torch.float32, with_mtp=False)
    cache = PagedKVCache(layout, num_blocks=120)
    n = len(lengths)
    tables = [list(range(i, 120, n)) for i in range(n)]
    model.forward_logits(ForwardBatch.build([_prompt(k, seed=k) for k in lengths], [0] * n, tables, BLOCK), cache)
    return model, cache, tables


def _decode_setup(topk: int, lengths: list[int]):
    """_prefilled, and a step of two new tokens for every sequence."""
    model, cache, tables = _prefilled(topk, lengths)
    decode = ForwardBatch.build([[5 + i, 6] for i in range(len(lengths))], lengths, tables, BLOCK)
    return model, cache, decode


@pytest.mark.parametrize("topk", [16, 32])
@torch.no_grad()
def test_grouped_attention_equals_per_sequence(monkeypatch, topk):
    """Mixed step: decodes (1 query), verifies (3 queries) and a prefill chunk, contexts on both
    sides of index_topk, interleaved block tables; logits and top-k equal the per-sequence path."""
    lengths = [9, 20, 47, 90, 31]
    model, cache, tables = _prefilled(topk, lengths)
    new = [[5], [6, 7, 8], [9], [10, 11, 12], _prompt(20, seed=3)]
    batch = ForwardBatch.build(new, lengths, tables, BLOCK)
    saved = cache.buffer.clone()

    # A decode-only step: one group whose tokens are one run of the batch (views, not gathers).
    decode = ForwardBatch.build([[5 + i] for i in range(5)], [n + 1 for n in lengths], tables, BLOCK)
    assert isinstance(model.context(decode, cache).decode_groups(16)[0].token_rows, slice)

    grouped_hidden, grouped_topk = model(model.context(batch, cache))
    grouped_decode, _ = model(model.context(decode, cache))
    grouped_cache = cache.buffer.clone()
    cache.buffer.copy_(saved)
    monkeypatch.setattr(MLAttention, "_decode_groups", lambda self, ctx: [])
    alone_hidden, alone_topk = model(model.context(batch, cache))
    alone_decode, _ = model(model.context(decode, cache))
    torch.testing.assert_close(grouped_decode, alone_decode, rtol=1e-4, atol=1e-4)

    assert len(model.context(batch, cache).decode_groups(16)) == 2  # 1-query and 3-query groups
    torch.testing.assert_close(grouped_hidden, alone_hidden, rtol=1e-4, atol=1e-4)  # summation order differs
    torch.testing.assert_close(grouped_cache, cache.buffer, rtol=1e-4, atol=1e-4)
    for g, a in zip(grouped_topk, alone_topk, strict=True):  # the same sets (a dense prefill's are unordered)
        assert g.sort(-1).values.tolist() == a.sort(-1).values.tolist()


@torch.no_grad()
def test_folded_projections_equal_the_unfolded_ones():
    """kv_b_proj folded into the query and output projections (AbsorbedProjections) gives the
    decode-group kernel the output it has with the projections run one after another."""
    model, cache, decode = _decode_setup(16, [9, 20, 47, 90, 31])
    saved = cache.buffer.clone()
    folded, folded_topk = model(model.context(decode, cache))
    attns = [layer.self_attn for name, layer in model.model.layers.items()]
    assert all(a.absorbed.folds for a in attns)
    for a in attns:
        a.absorbed.folds = False
    cache.buffer.copy_(saved)
    unfolded, unfolded_topk = model(model.context(decode, cache))
    torch.testing.assert_close(folded, unfolded, rtol=1e-4, atol=1e-4)  # summation order differs
    assert [t.tolist() for t in folded_topk] == [t.tolist() for t in unfolded_topk]


@torch.no_grad()
def test_contexts_within_index_topk_skip_the_indexer_and_select_all(monkeypatch):
    """With every context within index_topk the indexer's queries are not computed; the result is the
    one the indexer gives (it selects the whole context), also where the padded width exceeds it."""
    model, cache, decode = _decode_setup(30, [9, 20, 27, 17])  # contexts up to 29, padded to 32
    saved = cache.buffer.clone()
    calls = []
    queries_from = Indexer.queries_from
    monkeypatch.setattr(Indexer, "queries_from", lambda self, *a: calls.append(1) or queries_from(self, *a))
    skipped, skipped_topk = model(model.context(decode, cache))
    assert not calls
    monkeypatch.setattr(MLAttention, "_needs_index", lambda self, ctx: True)
    cache.buffer.copy_(saved)
    indexed, indexed_topk = model(model.context(decode, cache))
    assert calls
    torch.testing.assert_close(skipped, indexed, rtol=0, atol=0)
    assert [t.tolist() for t in skipped_topk] == [t.tolist() for t in indexed_topk]
