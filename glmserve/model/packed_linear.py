"""PackedLinear: a bias-free linear weight, laid out once in oneDNN's blocked format.

On a CPU, a bfloat16 `F.linear` runs oneDNN's matmul, which reorders the weight into its blocked
layout on every call. For the few rows of a decode step that reorder costs about a third of the
product (bundled model, 8 rows x 256 -> 2,048: 86 us, 59 us prepacked; the LM head 285 us, 180 us),
and more when the weight has left the cache since the last step. Prepacked, the same kernel computes
the same bits.

A float32 `F.linear` runs MKL, which reads the [out, in] weight across its rows: with a few rows of
input and a weight out of cache, 1.4-2x slower than oneDNN on the prepacked weight (AVX2, 8 rows x
256 -> 2,304: 503 against 257 us; the LM head 1,782 against 902 us). oneDNN's sums differ from MKL's in
the last bits (~1e-7 relative), and unlike MKL's they do not depend on how many rows a call has, up
to MAX_ROWS: so a row's result is the same in a decode step, a verification step or alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# oneDNN gives a row the same bits in any call of up to 32 rows; with 33-128 rows and 512 inputs or more
# (the bundled model's output and down projections) it sums some rows in another order (bf16, AMX Xeon).
# A batch-32 verification step (64 rows) then disagreed in the last bit with the decode step it
# verifies (32 rows), and greedy speculative output with plain greedy output (1 request in 32). Calls
# with more rows run in blocks of MAX_ROWS; only decode and verification steps come here.
MAX_ROWS = 32


@dataclass(frozen=True)
class PackedLinear:
    weight: torch.Tensor  # [out, in], as F.linear takes it
    packed: torch.Tensor | None  # the same weight in oneDNN's layout (None: F.linear on `weight`)

    @classmethod
    def of(cls, weight: torch.Tensor, prepack: bool = True) -> PackedLinear:
        return cls(weight, _packed(weight) if prepack and _packs(weight) else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight)
        if x.shape[0] <= MAX_ROWS:
            return self._product(x)
        return torch.cat([self._product(rows) for rows in x.split(MAX_ROWS)])

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        # oneDNN's opaque tensors have no storage to copy: pack the copied weight again
        return PackedLinear.of(copy.deepcopy(self.weight, memo), prepack=self.packed is not None)


def _packs(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def _packed(weight: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
