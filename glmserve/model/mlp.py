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
        return self.down_proj(silu_mul(gate, up))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; without autograd in place on `gate`, which callers pass as a temporary
    (fresh prefill-sized temporaries cost more in page faults than in arithmetic)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return F.silu(gate) * up
    return F.silu(gate, inplace=True).mul_(up)
