"""RMSNorm as GLM checkpoints define it: normalise in float32, scale in the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:
        # One fused op instead of six; equal to the path below within float rounding.
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalised in float32 by the fused op (bit-equal to x * rsqrt(mean(x^2) + eps) written out,
    # in half the ops), then scaled in the input dtype.
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
