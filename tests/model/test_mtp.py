"""The MTP layer equals DeepSeek-V3's multi-token prediction, written plainly here on transformers parts.

Reference: h'_t = Block(eh_proj([RMSNorm_e(embed(x_{t+1})); RMSNorm_h(h_t)])), logits_{t+2} =
lm_head(RMSNorm_shared(h'_t)), where h_t is the main model's final normed hidden state and Block is a
GLM-5 decoder layer (run here as a one-layer transformers GlmMoeDsaModel whose final norm is the
shared head's norm).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from reference import config_dict, make_reference

from glmserve.model.config import GlmConfig
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM, init_random, with_input_ids
from glmserve.model.kv_layout import KVLayout
from glmserve.model.loader import load_model
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.saver import save_model

TOL = 1e-4


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_mtp(ref, ours: GlmForCausalLM, raw: dict, ids: list[int]) -> torch.Tensor:
    """MTP logits for positions 0..len-2 (predicting tokens 2..len) from the plain definition."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaModel

    one = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    one.update(num_hidden_layers=1, first_k_dense_replace=0, indexer_types=["full"], mlp_layer_types=["sparse"])
    block = GlmMoeDsaModel(GlmMoeDsaConfig(**one)).eval()
    block.config._attn_implementation = "eager"
    mtp = ours.mtp
    prefix = f"model.layers.{ours.config.mtp_layer_index}."
    own = {k[len(prefix) :]: v for k, v in ours.state_dict().items() if k.startswith(prefix)}
    weights = {f"layers.0.{k}": v for k, v in own.items() if not k.startswith(("enorm", "hnorm", "eh_proj", "shared"))}
    weights["norm.weight"] = own["shared_head.norm.weight"]
    weights["embed_tokens.weight"] = ours.model.embed_tokens.weight
    block.load_state_dict(weights, strict=True)
    x = torch.tensor([ids])
    h = ref.model(x).last_hidden_state[0]  # main model, final norm applied
    eps = ours.config.rms_norm_eps
    emb = ref.model.embed_tokens(x[0, 1:])
    fused = mtp.eh_proj(torch.cat([_rms(emb, mtp.enorm.weight, eps), _rms(h[:-1], mtp.hnorm.weight, eps)], -1))
    out = block(inputs_embeds=fused[None]).last_hidden_state[0]
    return ref.lm_head(out)


@pytest.fixture(scope="module", params=["glm52_schedule", "very_sparse"])
def setup(request, tmp_path_factory):
    """transformers reference + glmserve model with a random MTP layer, saved and reloaded."""
    variant = request.param
    src = tmp_path_factory.mktemp(variant)
    ref = make_reference(src, variant, initializer_range=0.06)
    main = load_model(src, with_mtp=False)
    full = GlmForCausalLM(GlmConfig.from_pretrained(src))
    init_random(full, std=0.06, generator=torch.Generator().manual_seed(3))
    full.load_state_dict(main.state_dict(), strict=False)
    dst = tmp_path_factory.mktemp(variant + "_mtp")
    save_model(full, dst)
    shutil.copy(src / "config.json", dst)
    return ref, load_model(dst), config_dict(variant)


@torch.no_grad()
def test_mtp_logits_match_plain_definition(setup):
    ref, ours, raw = setup
    ids = torch.randint(2, 320, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    expected = _reference_mtp(ref, ours, raw, ids)
    block_size = 16
    layout = KVLayout.for_config(ours.config, block_size, torch.float32, with_mtp=True)
    cache = PagedKVCache(layout, num_blocks=20)
    table = [list(range(19, -1, -1))]
    # Main prefill over all but the last token, then MTP over positions 0..n-2 with tokens 1..n-1.
    batch = ForwardBatch.build([ids[:-1]], [0], table, block_size)
    hidden, _ = ours(ours.context(batch, cache))
    normed = ours.final_norm(hidden)
    mtp_batch = with_input_ids(batch, torch.tensor(ids[1:]))
    mtp_hidden, _ = ours.mtp_step(ours.context(mtp_batch, cache), normed)
    assert (ours.mtp_logits(mtp_hidden) - expected).abs().max().item() <= TOL


@torch.no_grad()
def test_mtp_decode_steps_over_the_cache_match(setup):
    """MTP KV written one position at a time (as drafting does) gives the same logits as one pass."""
    ref, ours, raw = setup
    ids = torch.randint(2, 320, (120,), generator=torch.Generator().manual_seed(6)).tolist()
    expected = _reference_mtp(ref, ours, raw, ids)
    layout = KVLayout.for_config(ours.config, 16, torch.float32, with_mtp=True)
    cache = PagedKVCache(layout, num_blocks=8)
    table = [list(range(8))]
    n0 = 100
    batch = ForwardBatch.build([ids[:-1]], [0], table, 16)
    normed = ours.final_norm(ours(ours.context(batch, cache))[0])
    head = ForwardBatch.build([ids[1 : n0 + 1]], [0], table, 16)
    ours.mtp_step(ours.context(head, cache), normed[:n0])
    for t in range(n0, len(ids) - 1):
        step = ForwardBatch.build([[ids[t + 1]]], [t], table, 16)
        got = ours.mtp_logits(ours.mtp_step(ours.context(step, cache), normed[t : t + 1])[0])
        assert (got[0] - expected[t]).abs().max().item() <= TOL


@torch.no_grad()
def test_mtp_kv_only_positions_then_one_query_match(setup):
    """Storing only the MTP KV of a prompt's positions (`mtp_step_kv`, no attention or MLP for them)
    leaves the cache as a full pass would: a query after them gets the reference logits."""
    ref, ours, raw = setup
    ids = torch.randint(2, 320, (150,), generator=torch.Generator().manual_seed(7)).tolist()
    expected = _reference_mtp(ref, ours, raw, ids)
    layout = KVLayout.for_config(ours.config, 16, torch.float32, with_mtp=True)
    cache = PagedKVCache(layout, num_blocks=10)
    table = [list(range(9, -1, -1))]
    batch = ForwardBatch.build([ids[:-1]], [0], table, 16)
    normed = ours.final_norm(ours(ours.context(batch, cache))[0])
    n0 = 140
    ours.mtp_step_kv(ours.context(ForwardBatch.build([ids[1 : n0 + 1]], [0], table, 16), cache), normed[:n0])
    for t in range(n0, len(ids) - 1):
        step = ForwardBatch.build([[ids[t + 1]]], [t], table, 16)
        got = ours.mtp_logits(ours.mtp_step(ours.context(step, cache), normed[t : t + 1])[0])
        assert (got[0] - expected[t]).abs().max().item() <= TOL


def _draft(ours, ids, steps, share):
    import dataclasses

    from glmserve.model.mtp_draft import DraftSeed, draft_tokens

    saved = ours.config
    ours.config = dataclasses.replace(saved, index_share_for_mtp_iteration=share)
    try:
        layout = KVLayout.for_config(saved, 16, torch.float32, with_mtp=True)
        cache = PagedKVCache(layout, num_blocks=12)
        table = list(range(12))
        n = len(ids)
        batch = ForwardBatch.build([ids], [0], [table], 16)
        normed = ours.final_norm(ours(ours.context(batch, cache))[0])
        # MTP prefill over positions 0..n-3, then draft from position n-2 (token n-1 known).
        ours.mtp_step(ours.context(with_input_ids(ForwardBatch.build([ids[1 : n - 1]], [0], [table], 16),
                                                  torch.tensor(ids[1 : n - 1])), cache), normed[: n - 2])
        seed = DraftSeed(normed[n - 2], ids[n - 1], n - 2, table)
        return draft_tokens(ours, cache, [seed], steps)
    finally:
        ours.config = saved


@torch.no_grad()
def test_draft_steps(setup):
    ref, ours, raw = setup
    ids = torch.randint(2, 320, (150,), generator=torch.Generator().manual_seed(8)).tolist()
    expected = _reference_mtp(ref, ours, raw, ids)
    shared_ids, shared_logits = _draft(ours, ids, 3, share=True)
    plain_ids, plain_logits = _draft(ours, ids, 3, share=False)
    # Step 1 is the plain MTP definition either way.
    assert (shared_logits[0, 0] - expected[-1]).abs().max().item() <= TOL
    assert (plain_logits[0, 0] - expected[-1]).abs().max().item() <= TOL
    if ours.config.index_topk >= len(ids) + 3:  # nothing to select: sharing changes nothing
        assert torch.allclose(shared_logits, plain_logits, atol=TOL)
    else:  # later steps really reuse step 1's selection instead of running the indexer
        assert not torch.allclose(shared_logits[0, 1:], plain_logits[0, 1:], atol=TOL)
