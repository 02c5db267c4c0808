"""Prefill on one engine, decode on another: the KV blocks move, the output does not change."""

from __future__ import annotations

import dataclasses

import pytest
from engine_fixtures import prompts, random_model

from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.engine.handoff import PrefillOutput
from glmserve.model.greedy import greedy_generate


@pytest.fixture(scope="module")
def model():
    return random_model(seed=1)


def _engine(model, mtp) -> Engine:
    return Engine(model, EngineConfig(block_size=16, kv_cache_bytes=2 * 2**20, max_step_tokens=40, mtp=mtp))


def _ship(prefill: Engine, decode: Engine, request_id: str, prompt: list[int], params: SamplingParams):
    """What the services do, minus the network: prefill with held blocks, copy them, continue."""
    prefill.add_request(request_id, prompt, dataclasses.replace(params, max_tokens=1), hold_blocks=True)
    while prefill.has_unfinished():
        prefill.step()
    held = prefill.held_prefill(request_id)
    dest = decode.reserve(request_id, len(prompt) + 1)
    decode.cache.buffer[dest] = prefill.cache.buffer[held.block_ids[: len(dest)]]  # the transfer
    assert prefill.release(request_id)
    return decode.add_prefilled(request_id, prompt, params, held.output)


@pytest.mark.parametrize("mtp", ["off", 2])
def test_prefill_then_decode_equals_one_engine(model, mtp):
    prefill, decode = _engine(model, mtp), _engine(model, mtp)
    ps = prompts(4, seed=21, min_len=10, max_len=90)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    outs = {f"r{i}": list(_ship(prefill, decode, f"r{i}", p, params).token_ids) for i, p in enumerate(ps)}
    reqs = {rid: decode.requests[rid] for rid in outs if rid in decode.requests}
    while decode.has_unfinished():
        decode.step()
    for i, p in enumerate(ps):
        rid = f"r{i}"
        out = reqs[rid].output_ids if rid in reqs else outs[rid]
        assert out == greedy_generate(model, p, 20, stop_ids=model.config.eos_token_ids, block_size=16)
    if mtp != "off":
        assert decode.stats.draft_tokens > 0
    for engine in (prefill, decode):
        engine.pool.check_integrity()
        assert engine.pool.num_used == 0


def test_reservation_released_on_abort(model):
    decode = _engine(model, 2)
    decode.reserve("x", 100)
    assert decode.pool.num_used > 0
    assert decode.abort("x")  # abort of a request still waiting for its KV frees the reservation
    assert decode.pool.num_used == 0 and not decode.abort("x")


def test_first_token_logprobs_cross_with_the_handoff(model):
    """The first token's logprob and top logprobs are prefill's; decode's first event carries them."""
    prefill, decode, alone = _engine(model, 2), _engine(model, 2), _engine(model, 2)
    prompt = prompts(1, seed=5, min_len=20, max_len=40)[0]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    first = _ship(prefill, decode, "r", prompt, params)
    events = [first]
    while decode.has_unfinished():
        events += decode.step()
    single = alone.generate([prompt], params)[0]
    shipped = [t for e in events for t in e.token_ids]
    assert shipped == single.output_ids
    logprobs = [lp for e in events for lp in e.logprobs]
    top = [t for e in events for t in e.top_logprobs]
    assert logprobs == pytest.approx(single.output_logprobs, abs=1e-5)
    assert [[i for i, _ in t] for t in top] == [[i for i, _ in t] for t in single.output_top_logprobs]
    assert len(first.top_logprobs) == 1 and len(first.top_logprobs[0]) == 3


def test_prefilled_hidden_of_the_wrong_size_is_refused(model):
    decode = _engine(model, 2)
    decode.reserve("r", 10)
    bad = PrefillOutput(first_token=3, mtp_hidden=b"\0" * 12)
    with pytest.raises(ValueError, match="^mtp_hidden:"):
        decode.add_prefilled("r", [1, 2, 3], SamplingParams(max_tokens=2), bad)
    assert decode.release("r") and decode.pool.num_used == 0  # the reservation stayed until released


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, temperature=0.0),
    SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
], ids=["free", "penalties"])
def test_a_resumed_request_goes_on_as_the_uninterrupted_one(model, params):
    """A stream migrated after ``k`` tokens (`SamplingParams.num_resumed`): prompt plus those tokens
    through prefill and decode again gives the rest of the uninterrupted output (greedy), with the
    penalties counting the resumed tokens as output."""
    prefill, decode, alone = _engine(model, 2), _engine(model, 2), _engine(model, 2)
    prompt = prompts(1, seed=9, min_len=20, max_len=40)[0]
    whole = alone.generate([prompt], params)[0].output_ids
    assert len(whole) > 8
    for k in (1, 7):
        resumed = dataclasses.replace(params, max_tokens=params.max_tokens - k, num_resumed=k)
        events = [_ship(prefill, decode, f"r{k}", prompt + whole[:k], resumed)]
        while decode.has_unfinished():
            events += decode.step()
        assert [t for e in events for t in e.token_ids] == whole[k:]
    assert decode.pool.num_used == 0
