"""decode_forward (GlmForCausalLM.decode) computes what the layers compute, for decode and verification
batches, within and beyond index_topk, and stores the same KV."""

from __future__ import annotations

import pytest
import torch
from reference import config_dict

from glmserve.model.attention import pad_topk, split_topk
from glmserve.model.config import GlmConfig
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM, init_random
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache

BLOCK = 8
NUM_BLOCKS = 160


def _model(variant: str, **overrides) -> GlmForCausalLM:
    config = GlmConfig.from_dict(config_dict(variant, **overrides))
    torch.manual_seed(0)
    model = GlmForCausalLM(config, with_mtp=False)
    init_random(model, std=0.2, generator=torch.Generator().manual_seed(1))
    return model.eval()


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefilled(model: GlmForCausalLM, lengths: list[int]) -> tuple[PagedKVCache, list[list[int]]]:
    """A cache holding prompts of `lengths` tokens in interleaved block tables."""
    layout = KVLayout.for_config(model.config, block_size=BLOCK, dtype=torch.float32, with_mtp=False)
    cache = PagedKVCache(layout, num_blocks=NUM_BLOCKS)
    n = len(lengths)
    tables = [list(range(i, NUM_BLOCKS, n)) for i in range(n)]
    with torch.inference_mode():
        model.forward_logits(ForwardBatch.build([_prompt(k, seed=k) for k in lengths], [0] * n, tables, BLOCK), cache)
    return cache, tables


def _step(model, lengths: list[int], queries: int, graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `queries` new tokens after each prompt, and the cache after them."""
    cache, tables = _prefilled(model, lengths)
    tokens = [[5 + n % 11 + j for j in range(queries)] for n in lengths]
    batch = ForwardBatch.build(tokens, lengths, tables, BLOCK)
    model.decode_graph_enabled = graph
    try:
        assert model.decodes(batch) == graph
        with torch.inference_mode():
            return model.forward_logits(batch, cache), cache.buffer
    finally:
        model.decode_graph_enabled = True


@pytest.mark.parametrize("variant", ["glm52_schedule", "all_full", "very_sparse"])
@pytest.mark.parametrize("queries", [1, 3])
def test_decode_equals_the_layers(variant, queries):
    # Contexts within index_topk (64; very_sparse 16) and beyond, in one batch, tables of unequal widths.
    model = _model(variant)
    lengths = [5, 40, 63, 70, 131]
    layers_logits, layers_cache = _step(model, lengths, queries, graph=False)
    graph_logits, graph_cache = _step(model, lengths, queries, graph=True)
    assert graph_logits.shape == layers_logits.shape
    assert (graph_logits - layers_logits).abs().max() < 1e-4
    assert torch.equal(graph_logits.argmax(-1), layers_logits.argmax(-1))
    assert (graph_cache - layers_cache).abs().max() < 1e-4  # the same KV, in the same places


def test_a_sequence_decodes_alike_alone_and_in_a_batch():
    # The engine batches what the greedy oracle runs alone: the rows must not depend on the company.
    model = _model("very_sparse")
    alone, _ = _step(model, [70], 1, graph=True)
    together, _ = _step(model, [12, 70, 33], 1, graph=True)
    assert (alone[0] - together[1]).abs().max() < 1e-5


def test_models_it_cannot_run_go_layer_by_layer():
    model = _model("grouped_experts")
    assert model.graph_unsupported is not None and "n_group" in model.graph_unsupported
    cache, tables = _prefilled(model, [10, 20])
    assert not model.decodes(ForwardBatch.build([[3], [4]], [10, 20], tables, BLOCK))


def test_decode_sees_changed_weights():
    model = _model("glm52_schedule")
    before, _ = _step(model, [30], 1, graph=True)
    with torch.no_grad():
        model.model.layers["0"].self_attn.q_a_proj.weight.mul_(2.0)
        model.model.layers["4"].mlp.experts.down_proj.mul_(0.5)
    after, _ = _step(model, [30], 1, graph=True)
    layers, _ = _step(model, [30], 1, graph=False)
    assert (after - before).abs().max() > 1e-2
    assert (after - layers).abs().max() < 1e-4


def _mtp_model(variant: str) -> GlmForCausalLM:
    config = GlmConfig.from_dict(config_dict(variant))
    torch.manual_seed(0)
    model = GlmForCausalLM(config, with_mtp=True)
    init_random(model, std=0.2, generator=torch.Generator().manual_seed(2))
    return model.eval()


def _mtp_step(model, lengths: list[int], queries: int, graph: bool, shared: list[torch.Tensor] | None = None):
    """(the MTP layer's output at each sequence's last position, its draft logits, the selection per
    sequence, the cache) of `queries` positions after each prompt, whose earlier MTP KV was stored
    through the layers."""
    layout = KVLayout.for_config(model.config, block_size=BLOCK, dtype=torch.float32, with_mtp=True)
    cache = PagedKVCache(layout, num_blocks=NUM_BLOCKS)
    n = len(lengths)
    tables = [list(range(i, NUM_BLOCKS, n)) for i in range(n)]
    prompts = [_prompt(k + queries + 1, seed=k) for k in lengths]
    hidden = torch.randn(sum(lengths) + n * queries, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    seqs = list(zip(prompts, lengths, hidden.split([k + queries for k in lengths]), strict=True))
    with torch.inference_mode():
        known = ForwardBatch.build([p[1 : k + 1] for p, k, _ in seqs], [0] * n, tables, BLOCK)
        model.mtp_step_kv(model.context(known, cache), torch.cat([h[:k] for _, k, h in seqs]))
        ids = torch.tensor([p[k + 1 : k + 1 + queries] for p, k, _ in seqs])
        rows = torch.cat([h[k:] for _, k, h in seqs])
        if graph:
            width = min(map(len, tables))
            positions = torch.tensor(lengths)[:, None] + torch.arange(queries)
            selected, valid = (None, None) if shared is None else pad_topk(shared)
            tables = torch.tensor([t[:width] for t in tables])
            last, logits, used = model.mtp_decode(cache, ids, rows, positions, tables, selected, valid)
            topk = shared or split_topk(used, model.config.index_topk, (positions[:, -1] + 1).tolist())
        else:
            batch = ForwardBatch.build(ids.tolist(), lengths, tables, BLOCK)
            out, topk = model.mtp_step(model.context(batch, cache), rows, shared)
            last = out.view(n, queries, -1)[:, -1]
            logits = model.mtp_logits(last)
    return last, logits, topk, cache.buffer


@pytest.mark.parametrize("variant", ["glm52_schedule", "very_sparse"])
@pytest.mark.parametrize("queries", [1, 2])
def test_mtp_decode_equals_the_layer(variant, queries):
    # The MTP layer in one function (the drafter's path) against MtpLayer.step: outputs, logits, the selection
    # each sequence's queries used, and the KV it stored; contexts within index_topk and beyond.
    model = _mtp_model(variant)
    lengths = [5, 40, 63, 70, 131]
    layer_out, layer_logits, layer_topk, layer_cache = _mtp_step(model, lengths, queries, graph=False)
    graph_out, graph_logits, graph_topk, graph_cache = _mtp_step(model, lengths, queries, graph=True)
    assert (graph_out - layer_out).abs().max() < 1e-4
    assert (graph_logits - layer_logits).abs().max() < 1e-4
    assert all(torch.equal(a, b) for a, b in zip(graph_topk, layer_topk, strict=True))
    assert (graph_cache - layer_cache).abs().max() < 1e-4


def test_mtp_decode_reuses_a_given_selection():
    # index_share_for_mtp_iteration: later draft steps attend an earlier step's selection (of unequal
    # widths here, so padded), not the layer's own.
    model = _mtp_model("very_sparse")
    lengths = [40, 70, 131]
    shared = [torch.arange(0, n, 3)[None] for n in (14, 20, 30)]
    layer_out, *_ = _mtp_step(model, lengths, 1, graph=False, shared=shared)
    graph_out, *_ = _mtp_step(model, lengths, 1, graph=True, shared=shared)
    own_out, *_ = _mtp_step(model, lengths, 1, graph=True)
    assert (graph_out - layer_out).abs().max() < 1e-4
    assert (graph_out - own_out).abs().max() > 1e-3
