"""The engine's outputs equal plain greedy decoding whatever the batching, drafting, caching or pressure."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import prompts, random_model

from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.greedy import greedy_generate
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache

MAX_NEW = 24


@pytest.fixture(scope="module")
def model():
    return random_model()


@pytest.fixture(scope="module")
def oracle(model):
    cache = {}

    def run(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = greedy_generate(model, prompt, MAX_NEW, stop_ids=model.config.eos_token_ids, block_size=16)
        return cache[key]

    return run


def _engine(model, **overrides) -> Engine:
    config = dict(block_size=16, kv_cache_bytes=4 * 2**20, max_step_tokens=256)
    return Engine(model, EngineConfig(**{**config, **overrides}))


def _check_pool(engine: Engine) -> None:
    engine.pool.check_integrity()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("mtp", ["off", 1, 3, "auto"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_equals_plain_greedy(model, oracle, mtp, batch):
    engine = _engine(model, mtp=mtp)
    ps = prompts(batch, seed=batch)
    reqs = engine.generate(ps, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    for p, r in zip(ps, reqs, strict=True):
        assert r.output_ids == oracle(p)
    if mtp not in ("off",):
        assert engine.stats.draft_tokens > 0
    _check_pool(engine)


def test_chunked_prefill_and_prefix_reuse(model, oracle):
    engine = _engine(model, mtp=2, max_step_tokens=20)
    ps = prompts(4, seed=11, min_len=40, max_len=100)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    first = engine.generate(ps, params)
    assert engine.stats.cached_prompt_tokens == 0
    again = engine.generate(ps, params)
    assert engine.stats.cached_prompt_tokens > 0
    for p, a, b in zip(ps, first, again, strict=True):
        assert a.output_ids == b.output_ids == oracle(p)
    _check_pool(engine)


def test_preemption_under_block_pressure(model, oracle):
    engine = _engine(model, mtp=2, kv_cache_bytes=12 * engine_block_bytes(model), max_num_seqs=8)
    ps = prompts(6, seed=5, min_len=20, max_len=60)
    reqs = engine.generate(ps, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert engine.stats.preemptions > 0
    for p, r in zip(ps, reqs, strict=True):
        assert r.output_ids == oracle(p)
    _check_pool(engine)


def engine_block_bytes(model) -> int:
    return _engine(model, mtp=1).cache.layout.bytes_per_block


@pytest.mark.parametrize("abort_after", [0, 1, 2, 5, 9])
def test_abort_at_any_step_frees_everything(model, oracle, abort_after):
    engine = _engine(model, mtp=2, max_step_tokens=32)
    ps = prompts(5, seed=abort_after)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(ps)]
    for _ in range(abort_after):
        engine.step()
    assert engine.abort("r1") and engine.abort("r3")
    assert not engine.abort("r3")
    while engine.has_unfinished():
        engine.step()
    for i in (0, 2, 4):
        assert reqs[i].output_ids == oracle(ps[i])
    assert reqs[1].finish_reason == "abort"
    _check_pool(engine)


def test_seeded_sampling_is_reproducible(model):
    ps = prompts(3, seed=3)
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=s) for s in (1, 2, 3)]
    a = _engine(model, mtp=2).generate(ps, params)
    b = _engine(model, mtp=2).generate(ps, params)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]


def test_bad_requests_change_nothing(model):
    engine = _engine(model)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request("x", [5, 10_000], SamplingParams())
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request("y", [], SamplingParams())
    engine.add_request("z", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("z", [5, 6], SamplingParams())
    assert list(engine.requests) == ["z"]


class _ByteTokenizer:
    """Token i is the character chr(97 + i % 26): enough to test stop strings without a real vocabulary."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)

    def token_bytes(self, token_id, skip_special_tokens=False):
        return self.decode([token_id]).encode()


def test_stop_strings_cut_the_text_and_end_the_request(model, oracle):
    prompt = prompts(1, seed=2)[0]
    full = oracle(prompt)
    text = _ByteTokenizer().decode(full)
    stop = text[5:7]
    engine = _engine(model, mtp=2)
    engine.tokenizer = _ByteTokenizer()
    req = engine.add_request("s", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop=(stop,)))
    streamed = ""
    while engine.has_unfinished():
        streamed += "".join(o.text for o in engine.step())
    assert req.finish_reason == "stop"
    assert streamed == req.output_text.text == text[: text.index(stop)]
    _check_pool(engine)


def test_logprobs_and_top_logprobs(model):
    import torch

    from glmserve.model.forward_batch import ForwardBatch

    prompt = prompts(1, seed=9)[0]
    engine = _engine(model, mtp=2)
    (req,) = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))
    assert len(req.output_logprobs) == len(req.output_top_logprobs) == len(req.output_ids)
    seq = prompt + req.output_ids
    with torch.no_grad():
        logits = model.forward_logits(ForwardBatch.build([seq], [0], [[0]], block_size=256))
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    for i, token in enumerate(req.output_ids):
        assert abs(req.output_logprobs[i] - float(expected[i, token])) < 1e-4
        ids = [t for t, _ in req.output_top_logprobs[i]]
        assert ids[0] == token and ids == expected[i].topk(3).indices.tolist()


def _mtp_rows_after(model, prompt, drafts_at_step, target: int):
    """Step one request until its MTP KV covers `target` positions; returns those MTP latent rows."""
    engine = _engine(model, mtp=1, prefix_caching=False)
    req = engine.add_request("r", prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    deferred, step = 0, 0
    while req.mtp_synced < target or req.mtp_pending:
        engine.drafter.fixed_drafts = drafts_at_step(step)
        engine.step()
        deferred = max(deferred, len(req.mtp_pending))
        step += 1
    view = engine.runner.cache.latent_view(model.config.mtp_layer_index)
    return PagedKVCache.gather(view, torch.tensor(req.block_ids), target), deferred, req.token_ids[: target + 1]


@torch.inference_mode()
def _reference_mtp_rows(model, token_ids: list[int]) -> torch.Tensor:
    """MTP latent rows of positions 0..n-2 from one plain pass: the main model over the tokens, then the
    MTP layer over every position in full."""
    block_size = 16
    layout = KVLayout.for_config(model.config, block_size, model.dtype, with_mtp=True)
    table = list(range(-(-len(token_ids) // block_size)))
    cache = PagedKVCache(layout, len(table))
    batch = ForwardBatch.build([token_ids[:-1]], [0], [table], block_size)
    normed = model.final_norm(model(model.context(batch, cache))[0])
    mtp_batch = ForwardBatch.build([token_ids[1:]], [0], [table], block_size)
    model.mtp_step(model.context(mtp_batch, cache), normed)
    view = cache.latent_view(model.config.mtp_layer_index)
    return PagedKVCache.gather(view, torch.tensor(table), len(token_ids) - 1)


@pytest.mark.parametrize("schedule", ["always", "now and then", "never"])
def test_the_mtp_kv_equals_a_plain_pass_however_drafting_goes(model, schedule):
    """Prompt positions (stored without outputs), decode steps that draft nothing (deferred) and
    drafting steps all leave the MTP layer's KV a plain pass over the sequence computes."""
    drafts_at = {"always": lambda step: 1, "now and then": lambda step: 0 if step % 4 else 1,
                 "never": lambda step: 0 if step < 12 else 1}[schedule]
    prompt = prompts(1, seed=5)[0]
    target = len(prompt) + 12
    rows, deferred, token_ids = _mtp_rows_after(model, prompt, drafts_at, target)
    if schedule != "always":
        assert deferred >= 2  # steps without drafts really happened
    torch.testing.assert_close(rows, _reference_mtp_rows(model, token_ids), rtol=1e-4, atol=1e-4)
