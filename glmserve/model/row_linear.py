"""row_linear: x @ weight.T with each row's bits independent of how many rows the call has.

MKL's float32 GEMM picks its kernel by the number of rows (one row; 2-15; 16 and more), and the
kernels sum in different orders: a token's router logits could differ in the last bits between a
decode step of 32 rows and a verification group of 5, and its top-k experts flip at a near-tie. (No
run has shown such a flip; the divergence that was seen came from oneDNN, see PackedLinear.MAX_ROWS.)
As a batch of one-row products every row takes the same kernel: the same bits at any batch size, for
~4 us more per call on a router's [32, 256] x [256, 8] (8.8 against 4.8 us).
"""

from __future__ import annotations

import torch


def row_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[N, out] = x [N, in] @ weight [out, in].T, row by row (see the module docstring)."""
    return torch.bmm(x.unsqueeze(1), weight.t().expand(x.shape[0], -1, -1)).squeeze(1)
