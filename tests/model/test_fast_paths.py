"""Inference fast paths equal the plain definitions: fused projections, the MoE and its router, RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from reference import config_dict

from glmserve.model import moe as moe_module
from glmserve.model import native_kernels
from glmserve.model.config import GlmConfig
from glmserve.model.fused_linear import FusedLinear
from glmserve.model.glm_model import init_random
from glmserve.model.mlp import GatedMLP
from glmserve.model.moe import MoE
from glmserve.model.norms import rms_norm


def _moe() -> MoE:
    moe = MoE(GlmConfig.from_dict(config_dict("glm52_schedule")))
    init_random(moe, std=0.2, generator=torch.Generator().manual_seed(0))
    return moe.eval()


def _plain_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE written out token by token."""
    _, weights, ids = moe.gate(x)
    ex = moe.experts
    out = moe.shared_experts.down_proj(
        F.silu(moe.shared_experts.gate_proj(x)) * moe.shared_experts.up_proj(x)
    )
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t], strict=True):
            gate, up = (ex.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += w * (ex.down_proj[e] @ (F.silu(gate) * up))
    return out


@torch.no_grad()
def test_bfloat16_experts_on_rounded_up_rows_give_every_row_its_own_result(monkeypatch):
    moe = _moe().to(torch.bfloat16)
    x = torch.randn(600, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    rounded = moe(x)  # experts' row counts are not multiples of the bucket: their windows take the next rows
    monkeypatch.setattr(moe_module, "BF16_ROW_BUCKET", 1)
    torch.testing.assert_close(rounded, moe(x), atol=0, rtol=0)


@torch.no_grad()
def test_moe_equals_the_token_by_token_definition():
    moe = _moe()
    g = torch.Generator().manual_seed(1)
    for n in (1, 5, 32, 200):  # decode-sized batches (some experts unused) to prefill-sized
        x = torch.randn(n, moe.gate.weight.shape[1], generator=g)
        torch.testing.assert_close(moe(x), _plain_moe(moe, x), atol=1e-5, rtol=1e-5)


def test_fused_linear_matches_layers_follows_updates_and_steps_aside_for_autograd():
    mlp = GatedMLP(16, 24)
    x = torch.randn(5, 16)
    with torch.no_grad():
        gate, up = mlp.gate_up(x)
        torch.testing.assert_close(gate, mlp.gate_proj(x))
        torch.testing.assert_close(up, mlp.up_proj(x))
        mlp.up_proj.weight.mul_(2.0)  # an in-place update (an optimizer step) must not go unseen
        torch.testing.assert_close(mlp.gate_up(x)[1], mlp.up_proj(x))
        mlp.gate_proj.weight = torch.nn.Parameter(torch.randn(24, 16))  # so must a new tensor
        torch.testing.assert_close(mlp.gate_up(x)[0], mlp.gate_proj(x))
    assert mlp.gate_up(x) is None  # autograd: the separate layers run and get their gradients
    mlp(x).sum().backward()
    assert mlp.gate_proj.weight.grad is not None and mlp.up_proj.weight.grad is not None
    assert FusedLinear([torch.nn.Linear(16, 4, bias=False).double()])(x) is None  # mixed dtypes


@torch.no_grad()
def test_bfloat16_rms_norm_is_the_checkpoints_definition_bit_for_bit(monkeypatch):
    """Normalise in float32, round to bf16, scale in bf16 (transformers' GLM RMSNorm written out). The
    torch ops; the native kernel sums the squares in another order (tests/model/test_native_kernels.py)."""
    monkeypatch.setattr(native_kernels, "get", lambda: None)
    gen = torch.Generator().manual_seed(3)
    for rows, size in ((1, 128), (32, 192), (257, 256), (2048, 1024)):
        x = (torch.randn(rows, size, generator=gen) * torch.rand(rows, 1, generator=gen) * 10).to(torch.bfloat16)
        weight = torch.randn(size, generator=gen).to(torch.bfloat16)
        h = x.float()
        plain = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        assert torch.equal(rms_norm(x, weight, 1e-6), plain)
