"""Checkpoints: transformers' layout, fused experts, shards, LayerSplit stages, dtypes, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from reference import make_reference
from safetensors.torch import load_file, save_file

from glmserve.core.errors import CheckpointError
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.loader import load_model
from glmserve.model.saver import save_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    make_reference(path, "glm52_schedule", initializer_range=0.06)
    return path


def _batch(n=150):
    ids = torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(7)).tolist()
    return ForwardBatch.build([ids], [0], [[0]], block_size=256)


@torch.no_grad()
def test_fused_and_sharded_round_trip(checkpoint, tmp_path):
    ours = load_model(checkpoint, with_mtp=False)
    save_model(ours, tmp_path, fused_experts=True, max_shard_bytes=200_000)
    shutil.copy(checkpoint / "config.json", tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    again = load_model(tmp_path, with_mtp=False)
    torch.testing.assert_close(again.forward_logits(_batch()), ours.forward_logits(_batch()), rtol=0, atol=1e-6)


@torch.no_grad()
def test_layersplit_stages_chain_to_the_whole_model(checkpoint):
    whole = load_model(checkpoint, with_mtp=False)
    first = load_model(checkpoint, layers=range(0, 3), with_mtp=False)
    second = load_model(checkpoint, layers=range(3, 6), with_mtp=False)
    assert first.lm_head is None and second.model.embed_tokens is None
    assert second.config.indexer_types[3] == "shared"  # stage 2 starts on a shared layer: top-k is carried
    batch = _batch()
    hidden, topk = first(first.context(batch))
    hidden, _ = second(second.context(batch), hidden, topk)
    assert torch.equal(second.logits(second.final_norm(hidden)), whole.forward_logits(batch))
    with pytest.raises(ValueError, match="top-k"):
        second(second.context(batch), hidden, None)


@torch.no_grad()
def test_bfloat16_keeps_fp32_where_the_reference_does(checkpoint):
    bf16 = load_model(checkpoint, dtype=torch.bfloat16, with_mtp=False)
    assert bf16.model.layers["1"].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert bf16.model.layers["0"].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert bf16.model.layers["3"].mlp.gate.e_score_correction_bias.dtype == torch.float32
    fp32 = load_model(checkpoint, with_mtp=False)
    diff = (bf16.forward_logits(_batch()).float() - fp32.forward_logits(_batch())).abs()
    assert diff.mean().item() < 0.02, diff.mean().item()  # bf16 rounding, not a wrong weight


def test_missing_and_unexpected_tensors_are_listed(checkpoint, tmp_path):
    tensors = load_file(checkpoint / "model.safetensors")
    shutil.copy(checkpoint / "config.json", tmp_path)
    broken = dict(tensors)
    del broken["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(broken, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        load_model(tmp_path, with_mtp=False)
    extra = {**tensors, "model.layers.1.self_attn.surprise": torch.zeros(2), "vision.tower": torch.zeros(1)}
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.1\.self_attn\.surprise, vision"):
        load_model(tmp_path, with_mtp=False)
    # A stage ignores other stages' layers, even broken ones.
    del extra["vision.tower"]
    save_file(extra, tmp_path / "model.safetensors")
    assert load_model(tmp_path, layers=range(2, 6), with_mtp=False).layer_range == range(2, 6)


def test_no_checkpoint_is_a_clear_error(tmp_path, checkpoint):
    shutil.copy(checkpoint / "config.json", tmp_path)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)
    config = json.loads((checkpoint / "config.json").read_text())
    with pytest.raises(ValueError, match="layers"):
        load_model(checkpoint, layers=range(4, config["num_hidden_layers"] + 1))
