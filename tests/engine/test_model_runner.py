"""ModelRunner on its own: chunked prefill and decode verification rows give the logits a plain
forward pass over the whole sequence gives (the batch mixes both, as engine steps do)."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import prompts, random_model

from glmserve.core.generation import SamplingParams
from glmserve.engine.model_runner import ModelRunner
from glmserve.engine.request import Request
from glmserve.engine.scheduler import ScheduledWork
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache

BLOCK = 16


@pytest.fixture(scope="module")
def model():
    return random_model(seed=3)


def _plain_logits(model, tokens: list[int]) -> torch.Tensor:
    """Every position's logits from one forward pass over ``tokens`` in a fresh cache."""
    blocks = -(-len(tokens) // BLOCK)
    cache = PagedKVCache(KVLayout.for_config(model.config, BLOCK, dtype=model.dtype, with_mtp=False), blocks)
    with torch.inference_mode():
        return model.forward_logits(ForwardBatch.build([tokens], [0], [list(range(blocks))], BLOCK), cache).float()


def test_prefill_chunks_then_decode_rows_match_a_plain_forward(model):
    cache = PagedKVCache(KVLayout.for_config(model.config, BLOCK, dtype=model.dtype, with_mtp=True), 32)
    runner = ModelRunner(model, cache)
    a_prompt, b_prompt = prompts(2, seed=9, min_len=30, max_len=50)
    a, b = Request("a", a_prompt, SamplingParams()), Request("b", b_prompt, SamplingParams())
    a.block_ids, b.block_ids = list(range(0, 8)), list(range(8, 16))
    # Step 1: a's first chunk and all of b's prompt.
    first = runner.run_main([ScheduledWork(a, 20, False), ScheduledWork(b, len(b_prompt), False)])
    assert first.logits[0] is None  # a's prompt is not done: no logits yet
    assert torch.allclose(first.logits[1][0], _plain_logits(model, b_prompt)[-1], atol=1e-4)
    a.num_computed, b.num_computed = 20, len(b_prompt)
    b.append_output([5])  # b sampled its first token
    b.drafts = [7, 9]  # and has two drafts to verify
    # Step 2: the rest of a's prompt, and b's pending token plus its drafts.
    second = runner.run_main([ScheduledWork(a, len(a_prompt) - 20, False), ScheduledWork(b, 3, True)])
    assert torch.allclose(second.logits[0][0], _plain_logits(model, a_prompt)[-1], atol=1e-4)
    expected = _plain_logits(model, b_prompt + [5, 7, 9])[-3:]  # after the pending token and each draft
    assert second.logits[1].shape == expected.shape and torch.allclose(second.logits[1], expected, atol=1e-4)
    assert [h.shape[0] for h in second.hidden] == [len(a_prompt) - 20, 3]


def test_graph_weights_are_checked_once_per_step_and_a_change_shows_at_the_next(model, monkeypatch):
    """The staleness check reads every parameter's version, so a step takes the weights once: its
    decode pass and its drafting passes share them, and the next step sees a changed weight."""
    cache = PagedKVCache(KVLayout.for_config(model.config, BLOCK, dtype=model.dtype, with_mtp=True), 8)
    runner = ModelRunner(model, cache)
    prompt = prompts(1, seed=4, min_len=20, max_len=30)[0]
    req = Request("a", prompt, SamplingParams())
    req.block_ids = list(range(4))
    prefill = runner.run_main([ScheduledWork(req, len(prompt), False)])
    req.num_computed = len(prompt)
    req.append_output([5])
    taken = []
    original = model.graph_weights
    monkeypatch.setattr(model, "graph_weights", lambda: taken.append(1) or original())
    step = runner.run_main([ScheduledWork(req, 1, True)])
    hidden = [prefill.hidden[0][-1:], step.hidden[0]]
    runner.run_mtp([req], [len(prompt) - 1], [torch.cat(hidden)], [[5, 6]])
    runner.run_mtp([req], [len(prompt) + 1], [step.hidden[0]], [[7]])
    assert len(taken) == 1
    head = model.lm_head.weight
    try:
        with torch.no_grad():
            head.mul_(2.0)  # in place: the same storage, a new version
        req.num_computed += 1
        req.append_output([6])
        doubled = runner.run_main([ScheduledWork(req, 1, True)])
        assert len(taken) == 2
        expected = _plain_logits(model, prompt + [5, 6])[-1]
        assert torch.allclose(doubled.logits[0][0], expected, atol=1e-4)
    finally:
        with torch.no_grad():
            head.mul_(0.5)
