"""PackedLinear: bfloat16 computes the same bits as F.linear, float32 the same values to rounding and the same
bits for a row however many rows a call has (oneDNN's layout, or bfloat16 panels for float32 weights that
bfloat16 holds); decode_forward with prepacked weights equals it without."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_decode_forward import BLOCK, NUM_BLOCKS, _model, _prompt

from glmserve.model import native_kernels
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.graph_weights import GraphWeights
from glmserve.model.kv_layout import KVLayout
from glmserve.model.packed_linear import PackedLinear
from glmserve.model.paged_cache import PagedKVCache

BF16_PACKS = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("rows", [1, 8, 33, 300])
def test_packed_bfloat16_linear_equals_f_linear_bit_for_bit(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).bfloat16()
    x = torch.randn(rows, 100, generator=gen).bfloat16()[:, 10:90]  # a strided view, as the decode pass slices
    linear = PackedLinear.of(weight)
    assert (linear.packed is not None) == BF16_PACKS
    assert torch.equal(linear(x), F.linear(x, weight))
    assert torch.equal(linear(x.view(1, rows, 80)), F.linear(x, weight).view(1, rows, 96))


def test_unpacked_weights_run_f_linear():
    weight = torch.randn(16, 8)
    assert PackedLinear.of(weight, prepack=False).packed is None
    assert PackedLinear.of(weight.bfloat16(), prepack=False).packed is None
    x = torch.randn(3, 8)
    assert torch.equal(PackedLinear.of(weight, prepack=False)(x), F.linear(x, weight))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_packed_float32_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2304, 256, generator=gen)
    x = torch.randn(40, 256, generator=gen)
    linear = PackedLinear.of(weight)
    assert linear.packed is not None
    whole = linear(x)
    torch.testing.assert_close(whole, F.linear(x, weight), rtol=1e-5, atol=1e-4)
    for rows in (1, 8, 9, 33):  # a decode step, a verification step, a row alone
        assert torch.equal(torch.cat([linear(part) for part in x.split(rows)]), whole)


@torch.no_grad()
def test_float32_weights_bfloat16_holds_run_as_bfloat16_panels():
    if native_kernels.get() is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2310, 200, generator=gen).bfloat16().float()  # the columns end inside a panel
    linear = PackedLinear.of(weight)
    assert linear.bf16_panels is not None and linear.packed is None
    x = torch.randn(70, 250, generator=gen)[:, 30:230]  # a strided view
    whole = linear(x)
    torch.testing.assert_close(whole, F.linear(x, weight), rtol=1e-5, atol=1e-4)
    for rows in (1, 3, 4, 5, 8, 33):  # a row's bits do not depend on the rows around it
        assert torch.equal(torch.cat([linear(part) for part in x.split(rows)]), whole)
    assert torch.equal(linear(x.reshape(2, 35, 200)), whole.view(2, 35, -1))
    copied = copy.deepcopy(linear)
    assert copied.bf16_panels is not None and torch.equal(copied(x), whole)
    assert torch.equal(PackedLinear.of(weight, prepack=False)(x), F.linear(x, weight))
    assert PackedLinear.of(weight + 1e-3).bf16_panels is None  # values bfloat16 would round: oneDNN's float32


def test_bfloat16_decode_is_the_same_with_and_without_prepacked_weights():
    model = _model("glm52_schedule").to(torch.bfloat16)
    logits = []
    for prepack in (True, False):
        layout = KVLayout.for_config(model.config, block_size=BLOCK, dtype=torch.bfloat16, with_mtp=False)
        cache = PagedKVCache(layout, num_blocks=NUM_BLOCKS)
        lengths = [9, 70]
        tables = [list(range(i, NUM_BLOCKS, 2)) for i in range(2)]
        model._graph_weights = GraphWeights.of(model, prepack=prepack)
        with torch.inference_mode():
            model.forward_logits(ForwardBatch.build([_prompt(k, seed=k) for k in lengths], [0, 0], tables, BLOCK), cache)
            step = ForwardBatch.build([[5], [6]], lengths, tables, BLOCK)
            assert model.decodes(step)
            logits.append(model.forward_logits(step, cache))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deep_copy_packs_its_own_weight(dtype):
    weight = torch.randn(32, 16).to(dtype)
    linear = PackedLinear.of(weight)
    copied = copy.deepcopy(linear)
    assert copied.weight is not linear.weight and torch.equal(copied.weight, weight)
    assert (copied.packed is None) == (linear.packed is None)
    x = torch.randn(5, 16).to(dtype)
    assert torch.equal(copied(x), linear(x))


@pytest.mark.cpu_feature(BF16_PACKS, feature="oneDNN bfloat16 (no bf16 instructions)")
def test_packed_bfloat16_rows_do_not_depend_on_the_batch():
    # With 33-128 rows and 512 inputs, oneDNN sums some rows in another order than with 32 or fewer: a
    # verification step of 64 rows disagreed with the decode step of 32 it verifies. Blocks of MAX_ROWS.
    gen = torch.Generator().manual_seed(0)
    linear = PackedLinear.of((torch.randn(256, 512, generator=gen) * 0.05).bfloat16())
    for _ in range(8):
        x = torch.randn(64, 512, generator=gen).bfloat16()
        whole = linear(x)
        assert torch.equal(whole[:32], linear(x[:32]))
        assert torch.equal(whole[40:41], linear(x[40:41]))
