"""A small random GLM-5 model with an MTP layer, and prompts, for engine tests."""

from __future__ import annotations

import torch

from glmserve.model.config import GlmConfig
from glmserve.model.glm_model import GlmForCausalLM, init_random

CONFIG = dict(
    model_type="glm_moe_dsa",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    index_topk=24,
    index_head_dim=32,
    index_n_heads=4,
    first_k_dense_replace=1,
    index_topk_freq=2,
    index_skip_topk_offset=1,
    num_nextn_predict_layers=1,
    index_share_for_mtp_iteration=True,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 8e6},
    eos_token_id=[1],
)


def random_model(seed: int = 0) -> GlmForCausalLM:
    model = GlmForCausalLM(GlmConfig.from_dict(CONFIG))
    init_random(model, std=0.08, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def prompts(n: int, seed: int = 0, min_len: int = 3, max_len: int = 120) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (n,), generator=g).tolist()
    return [torch.randint(2, CONFIG["vocab_size"], (m,), generator=g).tolist() for m in lengths]
