"""Gated SiLU MLP: the dense layers' feed-forward and the MoE's shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmserve.model.fused_linear import FusedLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_up(x)
        gate, up = (self.gate_proj(x), self.up_proj(x)) if fused is None else fused
        return self.down_proj(F.silu(gate) * up)
