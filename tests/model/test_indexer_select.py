"""Top-k selection is exact and does not depend on batching: ties go to earlier positions.

Every test runs twice: with the native kernel (where it builds) and with the torch ops."""

from __future__ import annotations

import pytest
import torch
from reference import config_dict

from glmserve.model import native_kernels
from glmserve.model.config import GlmConfig
from glmserve.model.indexer import Indexer, prefilter_group, top_k_earliest


@pytest.fixture(autouse=True, params=["native", "torch ops"])
def top_k_path(request, monkeypatch):
    if request.param == "torch ops":
        monkeypatch.setattr(native_kernels, "get", lambda: None)
    elif native_kernels.get() is None:
        pytest.skip("the native kernels did not build (no C++ compiler or ninja)")
    return request.param


def _indexer(topk: int) -> Indexer:
    return Indexer(GlmConfig.from_dict(config_dict("glm52_schedule", index_topk=topk)))


def test_ties_at_the_cut_go_to_earlier_positions():
    scores = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0, 0.0, 3.0]])
    assert _indexer(4).select(scores).tolist() == [[0, 1, 3, 6]]


def test_selection_ignores_masked_tail_and_other_rows():
    g = torch.Generator().manual_seed(0)
    scores = torch.relu(torch.randn(6, 50, generator=g)).round(decimals=1)  # many exact ties
    indexer = _indexer(12)
    alone = [indexer.select(row[None]) for row in scores]
    padded = torch.cat([scores, torch.full((6, 9), float("-inf"))], dim=1)
    together = indexer.select(padded)
    for i in range(6):
        assert together[i].tolist() == alone[i][0].tolist()
        top = scores[i].sort(descending=True, stable=True).indices[:12].sort().values
        assert together[i].tolist() == top.tolist()


def test_short_context_selects_everything():
    scores = torch.randn(3, 5)
    assert _indexer(64).select(scores).tolist() == [list(range(5))] * 3


def test_queries_before_position_k_skip_the_search_and_select_the_same():
    """select(scores, positions): queries at positions < k take 0..k-1 without a top-k search; the
    result equals the search over all queries (a prefill chunk starting at 0 and one after it)."""
    indexer = _indexer(16)
    g = torch.Generator().manual_seed(1)
    for cached, new in ((0, 40), (10, 20), (20, 5), (0, 12)):
        t = cached + new
        positions = torch.arange(cached, t)
        scores = torch.relu(torch.randn(new, t, generator=g)).round(decimals=1)
        scores = scores.masked_fill(torch.arange(t) > positions[:, None], float("-inf"))
        assert torch.equal(indexer.select(scores, positions), indexer.select(scores))


def test_negative_scores_and_signed_zeros_order_as_floats():
    """The search runs on int32 keys of the float32 scores: negative scores (a head weight below zero)
    keep their order, -0.0 ties with 0.0 (the earlier one wins), -inf stays last."""
    scores = torch.tensor([[-1.0, -0.0, -3.0, 0.0, -2.0, float("-inf"), -0.5, 0.0]])
    assert _indexer(2).select(scores).tolist() == [[1, 3]]  # -0.0 at 1 ties with the 0.0 at 3 and 7
    assert _indexer(5).select(scores).tolist() == [[0, 1, 3, 6, 7]]
    g = torch.Generator().manual_seed(2)
    scores = (torch.randn(5, 64, generator=g) * 4).round() * torch.randn(5, 64, generator=g).sign()
    scores[:, ::9] = -0.0
    for k in (1, 7, 20):
        top = scores.sort(descending=True, stable=True).indices[:, :k].sort().values
        assert _indexer(k).select(scores).tolist() == top.tolist()


def test_top_k_earliest_equals_a_stable_sort_on_rows_with_and_without_ties_at_the_cut():
    """Rows tied at the cut and rows not tied, in one call: each row as a stable descending sort takes it.
    Rows of 12+ times k scores search only the best groups' members (`prefilter_group`); rows of at most
    4 (k + 1) select by a mask at the cut (`SHORT_ROW`)."""
    g = torch.Generator().manual_seed(4)
    shapes = ((129, 128), (300, 128), (516, 128), (600, 128), (2000, 128), (50, 7), (16384, 128), (3001, 3), (1000, 1))
    for t, k in shapes:
        scores = torch.randn(24, t, generator=g)
        scores[::2] = (scores[::2] * 2).round()  # every other row: many exact ties, -0.0 among them
        scores[:, t // 2 :][torch.rand(24, t - t // 2, generator=g) < 0.3] = float("-inf")
        scores[1] = 0.0  # one group maximum everywhere: every group ties
        scores[3, ::5] = 9.0  # more of the best value than k, spread over every group
        top = scores.sort(descending=True, stable=True).indices[:, :k].sort().values
        assert torch.equal(top_k_earliest(scores, k), top)


def test_long_rows_take_the_group_prefilter_and_short_ones_do_not():
    assert prefilter_group(16384, 128) == 8 and prefilter_group(2000, 128) == 3
    assert prefilter_group(1024, 128) == 1 and prefilter_group(16384, 2048) == 1
