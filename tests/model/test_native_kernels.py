"""The native kernels compute what the torch ops compute: the top-k the same positions, for every row
length, tie pattern and causal length (`select_tiled` the same selection with it and without it); RoPE
the same bits; the bfloat16 RMSNorm the same values but for rare elements a rounding step apart; the
decode indexer's scores from the paged cache the same to float rounding, and so the absorbed attention over
the selected rows of the paged cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference import config_dict

from glmserve.model import native_kernels
from glmserve.model.attention import attend_rows, selected_rows
from glmserve.model.config import GlmConfig
from glmserve.model.indexer import Indexer, top_k_earliest
from glmserve.model.norms import rms_norm
from glmserve.model.rope import apply_rope


@pytest.fixture
def native():
    module = native_kernels.get()
    if module is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    return module.top_k_earliest


def _torch_ops(monkeypatch, scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The torch path's answer: later columns masked to -inf, as the causal mask does."""
    monkeypatch.setattr(native_kernels, "get", lambda: None)
    masked = scores.masked_fill(torch.arange(scores.shape[1]) >= lengths[:, None], float("-inf"))
    answer = top_k_earliest(masked, k)
    monkeypatch.undo()
    return answer


@pytest.mark.parametrize("ties", ["none", "relu zeros", "rounded", "signed zeros"])
def test_native_equals_the_torch_ops(native, monkeypatch, ties):
    g = torch.Generator().manual_seed(len(ties))
    for width, k in ((129, 128), (300, 128), (513, 128), (1500, 128), (5000, 128), (40, 7), (3000, 2)):
        scores = torch.randn(20, width, generator=g)
        if ties == "relu zeros":
            scores = scores.relu()
        elif ties == "rounded":
            scores = (scores * 2).round()
        elif ties == "signed zeros":
            scores = torch.where(torch.rand(20, width, generator=g) < 0.4, -0.0, scores.relu())
        lengths = torch.randint(1, width + 1, (20,), generator=g)
        lengths[:3] = torch.tensor([width, k, k + 1])  # whole rows, and rows at the cut
        expected = _torch_ops(monkeypatch, scores, lengths, k)
        assert torch.equal(native(scores, lengths, k, True), expected)
        assert torch.equal(native(scores, lengths, k, False).sort(-1).values, expected)


def test_a_misleading_sample_falls_back_to_the_whole_row(native, monkeypatch):
    """Long rows first keep the scores at or above a threshold from an evenly spaced sample (every 8th
    position of a 2,000-score row at k = 128); here those positions hold the row's best values, so fewer
    than k pass the threshold and the whole row is searched."""
    width, k = 2000, 128
    scores = torch.rand(4, width)
    scores[:, ::8] = 10.0 + torch.arange(width // 8, dtype=torch.float32)
    lengths = torch.full((4,), width)
    assert torch.equal(native(scores, lengths, k, True), _torch_ops(monkeypatch, scores, lengths, k))


def test_select_tiled_is_the_same_with_and_without_the_kernel(native, monkeypatch):
    indexer = Indexer(GlmConfig.from_dict(config_dict("glm52_schedule", index_topk=64)))
    g = torch.Generator().manual_seed(7)
    s, heads, dim = 700, indexer.n_heads, indexer.head_dim
    q = torch.randn(s, heads, dim, generator=g).bfloat16()
    keys = torch.randn(s, dim, generator=g).bfloat16()
    weights = torch.randn(s, heads, generator=g)
    positions = torch.arange(s)
    with_kernel = indexer.select_tiled(q, weights, keys, positions)
    unordered = indexer.select_tiled(q, weights, keys, positions, ascending=False).sort(-1).values
    monkeypatch.setattr(native_kernels, "get", lambda: None)
    assert torch.equal(with_kernel, indexer.select_tiled(q, weights, keys, positions))
    assert torch.equal(unordered, with_kernel)


@pytest.mark.parametrize("width", [256, 192, 7168, 7])
def test_rms_norm_equals_the_torch_ops_but_for_rare_rounding_steps(monkeypatch, width):
    if native_kernels.get() is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(3000, width, generator=g) * torch.rand(3000, 1, generator=g) * 10).bfloat16()
    weight = torch.randn(width, generator=g).bfloat16()
    native = rms_norm(x.view(3, 1000, width), weight, 1e-5).view(3000, width)
    monkeypatch.setattr(native_kernels, "get", lambda: None)
    torch_ops = rms_norm(x, weight, 1e-5)
    assert torch.equal(torch_ops, weight * F.rms_norm(x, weight.shape, None, 1e-5))
    apart = native != torch_ops
    assert apart.float().mean() < 1e-3
    # one bfloat16 step of the normalised value, scaled by the weight and rounded: two output steps at most
    steps = (torch_ops.float().abs() * 2.0**-6).clamp_min(1e-38)
    assert ((native.float() - torch_ops.float()).abs()[apart] <= steps[apart]).all()


@pytest.mark.parametrize("width", [256, 192, 7168, 7])
def test_float32_rms_norm_equals_the_torch_ops_to_a_few_last_bits(monkeypatch, width):
    if native_kernels.get() is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    g = torch.Generator().manual_seed(width)
    x = torch.randn(3000, width, generator=g) * torch.rand(3000, 1, generator=g) * 10
    weight = torch.randn(width, generator=g)
    native = rms_norm(x[:, None].expand(-1, 2, -1)[:, 1], weight, 1e-5)  # a strided input
    monkeypatch.setattr(native_kernels, "get", lambda: None)
    torch_ops = rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(native, torch_ops, rtol=5e-7, atol=1e-30)  # the mean a bit apart: 1-3 last bits


def test_rms_norm_outside_its_case_runs_the_torch_ops():
    """Either dtype under autograd (training) takes the torch ops."""
    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.rand(8)
    rms_norm(x, weight, 1e-5).sum().backward()
    assert x.grad is not None
    xb, wb = x.detach().bfloat16().requires_grad_(), weight.bfloat16()
    rms_norm(xb, wb, 1e-5).sum().backward()
    assert xb.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_is_the_torch_ops_bit_for_bit(monkeypatch, dtype):
    """Every layout the model passes: a rope slice of wider rows (not contiguous), heads in between,
    two leading dimensions (decode's [B, S]), and values that round (large angles, large x, inf, nan)."""
    if native_kernels.get() is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    g = torch.Generator().manual_seed(5)
    cases = (((7, 144), (7,), slice(128, 144)), ((300, 4, 64), (300,), slice(48, 64)),
             ((3, 2, 4, 64), (3, 2), slice(48, 64)), ((5, 4, 32), (5,), slice(0, 16)))
    for shape, lead, rope_slice in cases:
        x = (torch.randn(*shape, generator=g) * 300).to(dtype)[..., rope_slice]
        x[(0,) * (x.dim() - 1)][:2] = torch.tensor([float("inf"), float("nan")], dtype=dtype)
        angles = torch.randn(*lead, 8, generator=g) * 1e4
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        native = apply_rope(x, cos, sin)
        with monkeypatch.context() as m:
            m.setattr(native_kernels, "get", lambda: None)
            torch_ops = apply_rope(x, cos, sin)
        assert torch.equal(native.nan_to_num(), torch_ops.nan_to_num())
        assert torch.equal(native.isnan(), torch_ops.isnan())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()  # the kernel serves inference; under autograd the torch ops run
def test_paged_scores_equal_the_torch_ops_to_float_rounding(monkeypatch, dtype):
    """Keys in one layer's strided view of the block pool, blocks in any order, one query per sequence
    (decode) and several (verification); -inf exactly after each query's position."""
    if native_kernels.get() is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    indexer = Indexer(GlmConfig.from_dict(config_dict("glm52_schedule", index_topk=64)))
    heads, dim, block, num_blocks = indexer.n_heads, indexer.head_dim, 16, 90
    g = torch.Generator().manual_seed(11)
    pool = torch.randn(num_blocks, 40 + block * dim, generator=g).to(dtype)  # other layers' values around it
    view = pool[:, 40:].view(num_blocks, block, dim)
    for batch, queries, width in ((9, 1, 10), (3, 4, 5), (2, 1, 1)):
        tables = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width)
        last = torch.randint(queries - 1, width * block, (batch, 1), generator=g)
        positions = last - queries + 1 + torch.arange(queries)
        q = torch.randn(batch, queries, heads, dim, generator=g).to(dtype)
        weights = torch.rand(batch, queries, heads, generator=g)
        native = indexer.paged_scores(q, weights, view, tables, positions)
        with monkeypatch.context() as m:
            m.setattr(native_kernels, "get", lambda: None)
            torch_ops = indexer.paged_scores(q, weights, view, tables, positions)
        visible = torch.isfinite(torch_ops)
        assert torch.equal(visible, torch.isfinite(native))
        assert torch.equal(torch_ops[~visible], native[~visible])
        torch.testing.assert_close(native[visible], torch_ops[visible], rtol=1e-5, atol=1e-6)
        # a sequence's scores do not depend on the batch around it (decode and verification agree)
        alone = indexer.paged_scores(q[-1:], weights[-1:], view, tables[-1:], positions[-1:])
        assert torch.equal(alone, native[-1:])


def test_paged_scores_refuse_a_block_id_outside_the_pool():
    module = native_kernels.get()
    if module is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    view = torch.zeros(4, 16, 8)
    q, weights, positions = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2), torch.tensor([[20]])
    assert module.paged_index_scores(q, weights, view, torch.tensor([[3, 2]]), positions).shape == (1, 1, 32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        module.paged_index_scores(q, weights, view, torch.tensor([[1, 4]]), positions)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "width", "latent"), [(4, 144, 128), (5, 40, 24)])
@torch.no_grad()
def test_latent_attention_equals_the_torch_ops_to_float_rounding(monkeypatch, dtype, heads, width, latent):
    """Rows in one layer's strided view of the block pool, blocks in any order; decode and verification
    queries; selections of any width, with rows a query may not attend and a query that may attend none
    (it attends all alike, as the torch softmax over a filled mask does); head counts and widths off the
    kernel's groups of four heads and sixteen columns."""
    if native_kernels.get() is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    block, num_blocks = 16, 60
    g = torch.Generator().manual_seed(heads)
    pool = torch.randn(num_blocks, 24 + block * width, generator=g).to(dtype)  # other layers' values around it
    view = pool[:, 24:].view(num_blocks, block, width)
    for batch, queries, k in ((7, 1, 13), (3, 4, 40), (1, 1, 1)):
        tables = torch.randperm(num_blocks, generator=g)[: batch * 6].view(batch, 6)
        positions = torch.randint(k + queries, 6 * block, (batch, 1), generator=g) - queries + 1 + torch.arange(queries)
        selected = torch.stack([torch.randperm(int(p.max()) + 1, generator=g)[:k] for p in positions])
        selected = selected[:, None].expand(-1, queries, -1).clone()
        selected[0, 0, : k // 2] = positions[0, 0] + 1  # after the query: not attended
        valid = torch.ones_like(selected, dtype=torch.bool)
        valid[-1, -1] = False  # a query that may attend none of its rows
        query = (torch.randn(batch, queries, heads, width, generator=g) * 0.1).to(dtype)
        located = selected_rows(view, tables, positions, selected, valid)
        native = attend_rows(query, view, *located, latent)
        with monkeypatch.context() as m:
            m.setattr(native_kernels, "get", lambda: None)
            torch_ops = attend_rows(query, view, *located, latent)
        assert native.dtype == dtype and native.shape == torch_ops.shape == (batch, queries, heads, latent)
        tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(native, torch_ops, rtol=tolerance, atol=tolerance)
        # a sequence's output does not depend on the batch around it (decode and verification agree)
        alone = attend_rows(query[-1:], view, located[0][-1:], located[1][-1:], latent)
        assert torch.equal(alone, native[-1:])


def test_latent_attention_refuses_a_row_outside_the_cache():
    module = native_kernels.get()
    if module is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    view, query = torch.zeros(4, 16, 8), torch.zeros(1, 1, 2, 8)
    assert module.paged_latent_attention(query, view, torch.tensor([[[63, 0]]]), None, 4).shape == (1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="a row outside the cache"):
        module.paged_latent_attention(query, view, torch.tensor([[[64, 0]]]), None, 4)


def test_kernels_take_only_cpu_tensors_outside_autograd():
    module = native_kernels.get()
    if module is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    cpu, trained = torch.zeros(2), torch.zeros(2, requires_grad=True)
    assert native_kernels.for_tensors(cpu) is module
    assert native_kernels.for_tensors(cpu, torch.zeros(2, device="meta")) is None  # not in CPU memory
    assert native_kernels.for_tensors(cpu, trained) is None
    with torch.no_grad():
        assert native_kernels.for_tensors(cpu, trained) is module


def test_turned_off_by_its_environment_variable(monkeypatch):
    native_kernels.get.cache_clear()
    monkeypatch.setenv(native_kernels.ENV, "0")
    try:
        assert native_kernels.get() is None
    finally:
        native_kernels.get.cache_clear()
