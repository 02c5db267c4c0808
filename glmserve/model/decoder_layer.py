"""One GLM-5 decoder layer: pre-norm MLA attention and pre-norm MLP (dense or MoE)."""

from __future__ import annotations

import torch
from torch import nn

from glmserve.model.attention import MLAttention
from glmserve.model.config import GlmConfig
from glmserve.model.forward_context import ForwardContext
from glmserve.model.mlp import GatedMLP
from glmserve.model.moe import MoE
from glmserve.model.norms import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: GlmConfig, layer_idx: int, has_indexer: bool, mlp_type: str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer_idx, has_indexer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if mlp_type == "sparse" else GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self, hidden: torch.Tensor, ctx: ForwardContext, topk_in: list[torch.Tensor] | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        attn_out, topk = self.self_attn(self.input_layernorm(hidden), ctx, topk_in)
        hidden = hidden + attn_out
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, topk

    def write_kv(self, hidden: torch.Tensor, ctx: ForwardContext) -> None:
        """Only store the KV of the batch's tokens (what later queries attend to); no output."""
        self.self_attn.write_kv(self.input_layernorm(hidden), ctx)
