"""Rotary position embedding on the rope slice, GLM/DeepSeek interleaved flavour.

Pairs (x0, x1), (x2, x3), ... rotate together; the result is stored de-interleaved (evens then odds),
as the reference implementation does. Queries and keys use the same layout, so dot products agree.
"""

from __future__ import annotations

import torch

from glmserve.model import native_kernels


class Rope:
    def __init__(self, rope_dim: int, theta: float):
        # Explicit CPU device: models are built on the meta device before their weights are loaded.
        steps = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu")
        self.inv_freq = 1.0 / (theta ** (steps / rope_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each position's angles: two [N, rope_dim // 2] tensors in `dtype`."""
        angles = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [N, ..., rope_dim]; cos/sin are [N, rope_dim // 2] and broadcast over middle dims
    (N may be several leading dimensions of x: cos/sin's own leading ones)."""
    native = _native(x, cos, sin)
    if native is not None:  # one pass instead of ten ops, the same bits (csrc/rope.cpp)
        return native
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """The native kernel's rotation where it applies (one CPU dtype, no autograd), else None."""
    if x.dtype not in (torch.bfloat16, torch.float32) or cos.dtype != x.dtype or sin.dtype != x.dtype:
        return None
    lead = cos.shape[:-1]
    if x.shape[: len(lead)] != lead or sin.shape != cos.shape or x.dim() <= len(lead):
        return None
    kernels = native_kernels.for_tensors(x, cos, sin)
    if kernels is None:
        return None
    rows = cos.numel() // cos.shape[-1]
    return kernels.rope(x.reshape(rows, -1, x.shape[-1]), cos.reshape(rows, -1), sin.reshape(rows, -1)).view(x.shape)
