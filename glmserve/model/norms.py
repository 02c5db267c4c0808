"""RMSNorm as GLM checkpoints define it: normalise in float32, scale in the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmserve.model import native_kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float32):
        native = native_kernels.for_tensors(x, weight)
        if native is not None:  # one pass per row instead of six to eight ops (see csrc/rms_norm.cpp)
            return native.rms_norm(x, weight, eps)
    if x.dtype == weight.dtype == torch.float32:
        # One call instead of six; equal to the path below within float rounding.
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalised in float32 inside the fused op, rounded to the input dtype, then scaled in it: what
    # the checkpoint's norm computes, bit for bit, without converting x to float32 and back.
    return weight * F.rms_norm(x, weight.shape, None, eps)

