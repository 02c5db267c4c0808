"""Helpers shared by the model tests: tiny random GLM-5 configs and their transformers reference."""

from __future__ import annotations

from pathlib import Path

import torch

BASE_CONFIG = dict(
    model_type="glm_moe_dsa",
    architectures=["GlmMoeDsaForCausalLM"],
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=24,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_topk=64,
    index_head_dim=32,
    # 32 indexer heads as in GLM-5.2: an exact tie needs all 32 ReLUs at zero, so top-k cuts have no
    # ties, where the reference's choice would be whatever torch.topk does for that tensor shape.
    index_n_heads=32,
    first_k_dense_replace=2,
    index_topk_freq=4,
    index_skip_topk_offset=3,
    num_nextn_predict_layers=1,
    index_share_for_mtp_iteration=True,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 8e6},
    eos_token_id=[1],
    bos_token_id=0,
)

# (a) GLM-5.2-like schedule, (b) every layer full (GLM-5.1), (c) top-k far below the prompt, (d) groups.
VARIANTS = {
    "glm52_schedule": {},
    "all_full": {"index_topk_freq": 1, "index_skip_topk_offset": 0},
    "very_sparse": {"index_topk": 16},
    "grouped_experts": {"n_group": 4, "topk_group": 2, "n_routed_experts": 16, "num_experts_per_tok": 4},
}


def config_dict(variant: str = "glm52_schedule", **overrides) -> dict:
    return {**BASE_CONFIG, **VARIANTS[variant], **overrides}


def make_reference(tmp_path: Path, variant: str, seed: int = 0, **overrides):
    """A random transformers GlmMoeDsaForCausalLM (eager, float32) saved to tmp_path; returns it."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    raw = config_dict(variant, **overrides)
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    hf_config = GlmMoeDsaConfig(**raw)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(hf_config).eval()
    with torch.no_grad():  # non-trivial router bias and norms, so the tests see them
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    return model
