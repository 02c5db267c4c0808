"""LayerSplit stages chained in one process write the same KV bytes and first token as one engine."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import CONFIG, prompts, random_model

from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.engine.stage_engine import StageEngine, chunk_spans, kv_writes
from glmserve.kv.block_pool import OutOfBlocks
from glmserve.model.config import GlmConfig
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.layer_split import parse_layer_split, plan_layer_split
from glmserve.model.loader import load_model
from tests.shared import MODEL_DIR, requires_model

BS, CHUNK = 16, 96
ENGINE = EngineConfig(block_size=BS, kv_cache_bytes=8 * 2**20, max_step_tokens=CHUNK)
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)  # the first token's logprobs cross too


def stage_models(whole: GlmForCausalLM, ranges) -> list[GlmForCausalLM]:
    """Stage models holding exactly the whole model's weights of their layers."""
    state = whole.state_dict()
    out = []
    for r in ranges:
        stage = GlmForCausalLM(whole.config, r).to(whole.dtype)
        stage.load_state_dict({k: state[k] for k in stage.state_dict()})
        out.append(stage.eval())
    return out


def whole_prefill(engine: Engine, key: str, prompt: list[int]):
    """A prefill worker's run on one engine: the prompt's block rows, the first token, the MTP seed."""
    engine.add_request(key, prompt, GREEDY, hold_blocks=True)
    while not any(e.finished for e in engine.step()):
        pass
    held = engine.held_prefill(key)
    rows = engine.kv_buffer[held.block_ids[: -(-len(prompt) // BS)]].clone()
    engine.release(key)
    return rows, held.output


def staged_prefill(stages: list[StageEngine], carries: list[bool], key: str, prompt: list[int]):
    """The stage services' protocol without the network: agree on the cached prefix, run each chunk
    through every stage in order, collect every stage's slice of every block."""
    num_cached = min(s.begin(key, prompt, GREEDY) for s in stages)
    for s in stages:
        s.admit(key, num_cached)
    shipped: list[list[int]] = [[] for _ in stages]
    writes = dict(kv_writes(num_cached, len(prompt), CHUNK, BS, stream=True))
    assert [b for r in writes.values() for b in r] == list(range(-(-len(prompt) // BS)))  # each block once
    handoff = None
    for i, (start, n) in enumerate(chunk_spans(num_cached, len(prompt), CHUNK)):
        hidden = topk = None
        for k, s in enumerate(stages):
            out = s.run_chunk(key, start, n, hidden, topk if carries[k] else None)
            hidden, topk = out.hidden, out.topk
            if i in writes:  # what the stage writes to the decode worker after this chunk
                shipped[k] += s.block_ids(key, writes[i])
            handoff = out.handoff or handoff
    rows = torch.cat([s.kv_buffer[ids] for s, ids in zip(stages, shipped, strict=True)], dim=1)
    for s in stages:
        s.release(key)
    return rows, handoff, num_cached


def _whole_results(model, ps):
    engine = Engine(model, ENGINE, revision="r")
    return engine.cache_root, [whole_prefill(engine, f"w{i}", p) for i, p in enumerate(ps)]


def _check_equal(whole, model, plan, ps):
    root, results = whole
    stages = [StageEngine(m, ENGINE, revision="r") for m in stage_models(model, plan.ranges)]
    assert {s.cache_root for s in stages} == {root}  # one hash for the whole model's block
    carries = [plan.carries_topk(k) for k in range(len(stages))]
    for i, (prompt, (want_rows, want)) in enumerate(zip(ps, results, strict=True)):
        rows, out, cached = staged_prefill(stages, carries, f"s{i}", prompt)
        assert cached == want.num_cached_tokens == out.num_cached_tokens and (i == 0 or cached > 0)
        assert out.first_token == want.first_token and out.mtp_hidden == want.mtp_hidden
        assert out.first_logprob == pytest.approx(want.first_logprob, abs=1e-5)
        assert [t for t, _ in out.first_top_logprobs] == [t for t, _ in want.first_top_logprobs]
        assert rows.shape == want_rows.shape
        assert torch.equal(rows.view(torch.uint8), want_rows.view(torch.uint8)), f"prompt {i}: KV bytes differ"
    for s in stages:
        s.pool.check_integrity()
        assert s.pool.num_used == 0 and not s.jobs


def _prompts_with_prefix_hits(vocab: int, n: int) -> list[list[int]]:
    """Prompts longer than index_topk, chunked, the later ones sharing block-aligned prefixes."""
    base = prompts(1, seed=3, min_len=n, max_len=n + 1)[0]
    g = torch.Generator().manual_seed(4)
    tail = torch.randint(2, vocab, (70,), generator=g).tolist()
    return [base, base[: 3 * BS] + tail, base[: 5 * BS + 3] + tail[:40]]


BUNDLED_PROMPTS = _prompts_with_prefix_hits(8192, 300)


@pytest.fixture(scope="module")
def bundled():
    model = load_model(MODEL_DIR)
    assert len(BUNDLED_PROMPTS[0]) > model.config.index_topk
    return model, _whole_results(model, BUNDLED_PROMPTS)


@requires_model
@pytest.mark.parametrize("split", ["0-7", "planned-2", "planned-4"])
def test_bundled_model_stages_equal_one_engine(bundled, split):
    model, whole = bundled
    config = model.config
    plan = plan_layer_split(config, int(split[-1])) if split.startswith("planned") else parse_layer_split(split, config)
    if split == "planned-2":
        assert plan.carries_topk(1)  # the balanced boundary falls on shared layer 4
    _check_equal(whole, model, plan, BUNDLED_PROMPTS)


@pytest.mark.parametrize("spec", ["0-0,1-3", "0-0,1-1,2-2,3-3"])
def test_random_config_with_boundaries_on_shared_layers(spec):
    model = random_model(seed=2)
    config = GlmConfig.from_dict(CONFIG)
    plan = parse_layer_split(spec, config)
    assert plan.carries_topk(1) and config.indexer_types[1] == "shared"
    ps = _prompts_with_prefix_hits(config.vocab_size, 150)
    _check_equal(_whole_results(model, ps), model, plan, ps)


def test_a_stage_starting_on_a_shared_layer_needs_the_carried_topk():
    model = random_model(seed=2)
    first, second = (StageEngine(m, ENGINE) for m in stage_models(model, [range(0, 1), range(1, 4)]))
    prompt = prompts(1, seed=5, min_len=40, max_len=41)[0]
    for s in (first, second):
        s.begin("k", prompt, GREEDY)
        s.admit("k", 0)
    out = first.run_chunk("k", 0, 40)
    with pytest.raises(ValueError, match="top-k"):
        second.run_chunk("k", 0, 40, out.hidden, None)
    with pytest.raises(ValueError, match="start"):
        first.run_chunk("k", 8, 10)


def test_kv_writes_cover_every_block_once():
    assert kv_writes(0, 100, 40, 16, stream=True) == [(0, range(0, 2)), (1, range(2, 5)), (2, range(5, 7))]
    assert kv_writes(32, 100, 40, 16, stream=True) == [(0, range(0, 4)), (1, range(4, 7))]
    assert kv_writes(0, 10, 40, 16, stream=True) == [(0, range(0, 1))]
    assert kv_writes(0, 100, 40, 16, stream=False) == [(2, range(0, 7))]
    assert kv_writes(0, 100, 8, 16, stream=True)[:2] == [(1, range(0, 1)), (3, range(1, 2))]  # a chunk < block


def test_the_replica_keeps_the_shortest_stage_hit_and_out_of_blocks_holds_nothing():
    model = random_model(seed=2)
    stage = StageEngine(stage_models(model, [range(0, 4)])[0], ENGINE)
    prompt = prompts(1, seed=6, min_len=100, max_len=101)[0]
    stage.begin("a", prompt, GREEDY)
    stage.admit("a", 0)
    for start, n in chunk_spans(0, 100, CHUNK):
        stage.run_chunk("a", start, n)
    stage.release("a")
    assert stage.begin("b", prompt, GREEDY) == 96  # six full blocks cached (never the last token's)
    stage.admit("b", 32)  # another stage of the replica holds only two
    assert stage.num_cached("b") == 32
    stage.abort("b")
    small = StageEngine(stage_models(model, [range(0, 4)])[0],
                        EngineConfig(block_size=BS, kv_cache_bytes=4 * stage.layout.bytes_per_block))
    small.begin("c", prompt, GREEDY)
    with pytest.raises(OutOfBlocks):
        small.admit("c", 0)
    assert not small.jobs and small.pool.num_used == 0


def test_the_last_stage_samples_the_first_token_as_the_engine_does_with_logit_bias():
    """logit_bias (as grammars and penalties) reaches the first token a replica samples; its
    logprobs stay the model's own, as one Engine reports them."""
    model = random_model(seed=2)
    params = SamplingParams(max_tokens=1, temperature=0.0, logit_bias={7: 100.0}, logprobs=2)
    prompt = prompts(1, seed=7, min_len=50, max_len=51)[0]
    engine = Engine(model, ENGINE)
    engine.add_request("e", prompt, params, hold_blocks=True)
    while not any(e.finished for e in engine.step()):
        pass
    want = engine.held_prefill("e").output
    first, last = (StageEngine(m, ENGINE) for m in stage_models(model, [range(0, 2), range(2, 4)]))
    for s in (first, last):
        s.begin("k", prompt, params)
        s.admit("k", 0)
    out = first.run_chunk("k", 0, 50)
    got = last.run_chunk("k", 0, 50, out.hidden, out.topk).handoff
    assert got.first_token == want.first_token == 7
    assert got.first_logprob == pytest.approx(want.first_logprob, abs=1e-5)
    assert [t for t, _ in got.first_top_logprobs] == [t for t, _ in want.first_top_logprobs]
