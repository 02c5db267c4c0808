"""Rotary position embedding on the rope slice, GLM/DeepSeek interleaved flavour.

Pairs (x0, x1), (x2, x3), ... rotate together; the result is stored de-interleaved (evens then odds),
as the reference implementation does. Queries and keys use the same layout, so dot products agree.
"""

from __future__ import annotations

import torch


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
    """Rotate `x` [N, ..., rope_dim]; cos/sin are [N, rope_dim // 2] and broadcast over middle dims."""
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
