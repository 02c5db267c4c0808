"""FusedLinear: several bias-free Linear layers that read the same input, run as one matmul.

On small batches every matmul costs more in per-op overhead than in arithmetic, so layers that share
their input (q_a_proj and kv_a_proj_with_mqa, gate_proj and up_proj, ...) are better run together.
The layers themselves stay as they are (checkpoint names, saving and training see no change); the
concatenated weight is a cache, rebuilt whenever a part's storage or version changes. Under autograd
the separate layers run, so each keeps its own gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear:
    def __init__(self, layers: list[nn.Linear]):
        # A plain list, not an nn.ModuleList: the layers stay registered under their own names.
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Each layer's output on `x`, in the order the layers were given; None where the caller must run
        the layers itself (under autograd, or when the weights' dtypes differ from the input's)."""
        weights = [layer.weight for layer in self.layers]
        if self._autograd(x, weights) or any(w.dtype != x.dtype for w in weights):
            return None
        return list(F.linear(x, self._fused(weights)).split(self.sizes, dim=-1))

    @staticmethod
    def _autograd(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))

    def _fused(self, weights: list[torch.Tensor]) -> torch.Tensor:
        key = version_key(weights)
        if key != self._key:
            with torch.inference_mode(False), torch.no_grad():
                self._weight = torch.cat(weights)
            self._key = key
        return self._weight


def version_key(weights: list[torch.Tensor]) -> tuple:
    """What a cache of tensors derived from `weights` must match: each one's storage, version, dtype
    and device."""
    return tuple((w.data_ptr(), _version(w), w.dtype, w.device) for w in weights)


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place update counter (tensors made in inference mode have none: never updated)."""
    try:
        return t._version
    except RuntimeError:
        return 0
