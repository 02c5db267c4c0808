"""row_linear: a row's product has the same bits at any number of rows (MKL's float32 GEMM does not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmserve.model.row_linear import row_linear


def test_a_row_has_the_same_bits_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 256, generator=gen)  # a router: 8 experts over a hidden size of 256
    x = torch.randn(64, 256, generator=gen)
    alone = row_linear(x[:1], weight)
    assert all(torch.equal(row_linear(x[:n], weight)[:1], alone) for n in (2, 5, 16, 32, 64))
    torch.testing.assert_close(row_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
