"""Prefill on one engine, decode on another: the KV blocks move, the output does not change."""

from __future__ import annotations

import pytest
from engine_fixtures import prompts, random_model

from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.model.greedy import greedy_generate


@pytest.fixture(scope="module")
def model():
    return random_model(seed=1)


def _engine(model, mtp) -> Engine:
    return Engine(model, EngineConfig(block_size=16, kv_cache_bytes=2 * 2**20, max_step_tokens=40, mtp=mtp))


def _ship(prefill: Engine, decode: Engine, request_id: str, prompt: list[int], params: SamplingParams):
    """What the services do, minus the network: prefill with held blocks, copy them, continue."""
    prefill.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_blocks=True)
    while request_id in prefill.requests:
        prefill.step()
    held = prefill.held[request_id]
    dest = decode.reserve(request_id, len(prompt) + 1)
    src = held.block_ids[: len(dest)]
    decode.cache.buffer[dest] = prefill.cache.buffer[src]  # the transfer (NIXL or TCP in the services)
    first = held.output_ids[0]
    hidden = held.last_hidden
    assert prefill.release(request_id)
    return decode.add_prefilled(request_id, prompt, params, first, hidden)


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
