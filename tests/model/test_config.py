"""GlmConfig reads Hugging Face configs, derives the schedules transformers derives, rejects the rest."""

from __future__ import annotations

import json

import pytest
import torch

from glmserve.model.config import GlmConfig
from glmserve.model.kv_layout import KVLayout

# The real GLM-5.2 (753B) config.json fields that matter here.
GLM52 = {
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 3,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "num_nextn_predict_layers": 1,
    "index_share_for_mtp_iteration": True,
    "max_position_embeddings": 1048576,
    "rope_theta": 8000000.0,
    "eos_token_id": [154820, 154827, 154829],
}


def test_glm52_indexer_schedule():
    config = GlmConfig.from_dict(GLM52)
    assert config.full_indexer_layers == (0, 1, 2, *range(6, 78, 4))
    assert config.full_indexer_layers[-1] == 74 and len(config.full_indexer_layers) == 21
    assert config.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert config.indexer_source(5) == 2 and config.indexer_source(9) == 6 and config.indexer_source(77) == 74
    assert config.rope_theta == 8e6 and config.eos_token_ids == (154820, 154827, 154829)
    assert config.mtp_layer_index == 78


def test_glm52_kv_bytes_per_token():
    layout = KVLayout.for_config(GlmConfig.from_dict(GLM52), block_size=64, dtype=torch.bfloat16)
    assert layout.main_bytes_per_token == 95_232
    # The MTP layer adds its own latent (1,152 B) and indexer key (256 B) per token.
    assert layout.bytes_per_token == 95_232 + 1_152 + 256
    print(layout.describe())


def test_schedule_matches_transformers():
    from transformers import GlmMoeDsaConfig

    for extra in ({"index_topk_freq": 4, "index_skip_topk_offset": 3}, {}, {"index_topk_pattern": "FSFSSFSS"}):
        raw = {**GLM52, "num_hidden_layers": 8, **extra}
        hf = GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
        assert list(GlmConfig.from_dict(raw).indexer_types) == hf.indexer_types


def test_from_pretrained(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GLM52))
    assert GlmConfig.from_pretrained(tmp_path).num_hidden_layers == 78
    (tmp_path / "config.json").write_text(json.dumps({**GLM52, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        GlmConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type"),
        ({"indexer_types": ["full"] * 77 + ["dense"]}, "indexer_types"),
        ({"indexer_types": ["full"] * 10}, "indexer_types"),
        ({"indexer_types": ["shared"] + ["full"] * 77}, "indexer_types"),
        ({"mlp_layer_types": ["dense"] * 3}, "mlp_layer_types"),
        ({"index_topk_pattern": "FSX"}, "index_topk_pattern"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"n_group": 3}, "n_group"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_rejects_what_it_cannot_serve(change, field):
    with pytest.raises(ValueError, match=field):
        GlmConfig.from_dict({**GLM52, **change})
