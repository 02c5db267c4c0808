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

A float32 model loaded from a bfloat16 checkpoint holds bfloat16 values in twice the bytes, and at a
decode step's few rows reading the weights is most of a product's time (the bundled model's ~44 MB a
step exceed a small CPU's L3). Such a weight is kept as bfloat16 panels for the native kernel
(csrc/bf16_weight_linear.cpp), which computes the same float32 products from half the bytes: AVX2 EPYC,
cold weights, 0.4-0.55x oneDNN's time at 8 rows, 0.65-0.83x at 32. Each row is summed alone in one
order: the same bits at any row count.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glmserve.model import native_kernels

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
    # A float32 weight that bfloat16 holds exactly (a bfloat16 checkpoint's), as the native kernel's
    # bfloat16 panels (csrc/bf16_weight_linear.cpp): half the bytes to read, the same float32 products.
    bf16_panels: torch.Tensor | None = None

    @classmethod
    def of(cls, weight: torch.Tensor, prepack: bool = True) -> PackedLinear:
        native = native_kernels.get() if prepack and _bf16_exact(weight) else None
        if native is not None:
            with torch.inference_mode(False), torch.no_grad():
                return cls(weight, None, native.pack_bf16_weight(weight.detach()))
        return cls(weight, _packed(weight) if prepack and _packs(weight) else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16_panels is not None and x.dtype == torch.float32:
            native = native_kernels.for_tensors(x)
            if native is not None:
                out = native.bf16_weight_linear(x.reshape(-1, x.shape[-1]), self.bf16_panels, self.weight.shape[0])
                return out.view(*x.shape[:-1], -1)
        if self.packed is None or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight)
        if x.shape[0] <= MAX_ROWS:
            return self._product(x)
        return torch.cat([self._product(rows) for rows in x.split(MAX_ROWS)])

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        # oneDNN's opaque tensors have no storage to copy: pack the copied weight again
        prepacked = self.packed is not None or self.bf16_panels is not None
        return PackedLinear.of(copy.deepcopy(self.weight, memo), prepack=prepacked)


def _bf16_exact(weight: torch.Tensor) -> bool:
    """A float32 CPU matrix whose every value bfloat16 holds (a bfloat16 checkpoint run in float32)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    with torch.no_grad():
        return torch.equal(weight.bfloat16().float(), weight)


def _packs(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def _packed(weight: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
