"""Logit bias, repetition / presence / frequency penalties, banned tokens and min_p against reference
computations written out per token (plain Python over the vocabulary, no shared code with the
engine): greedy decoding in the engine (with and without MTP drafts, batched with a free request)
equals a one-token-at-a-time decoder applying the reference; a banned token never comes out even
when its logit beats every other by far more than any bias can take back; min_p keeps exactly the
tokens whose probability is at least min_p times the largest."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from constrained_fixtures import reference_greedy
from engine_fixtures import prompts, random_model
from torch import nn

from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.engine.sampler import processed_probs

MAX_NEW = 24
BIAS = {7: 3.0, 11: -100.0, 42: 1.5}


@pytest.fixture(scope="module")
def model():
    return random_model(seed=4)


def reference(prompt: list[int], params: SamplingParams):
    """``process(logits, output)`` as OpenAI / vLLM define the parameters, one token at a time."""
    bias = dict(params.logit_bias)

    def process(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        values = logits.tolist()
        seen = set(prompt) | set(out)
        for t in range(len(values)):
            x = values[t] + bias.get(t, 0.0)
            if t in seen:
                r = params.repetition_penalty
                x = x / r if x > 0 else x * r
            count = out.count(t)
            x -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
            values[t] = x
        return torch.tensor(values)

    return process


CASES = {
    "bias": SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias=BIAS),
    "repetition": SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.8),
    "presence+frequency": SamplingParams(max_tokens=MAX_NEW, temperature=0.0, presence_penalty=1.5,
                                         frequency_penalty=0.7),
    "all": SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias=BIAS, repetition_penalty=0.7,
                          presence_penalty=-0.5, frequency_penalty=2.0),
}


@pytest.fixture(scope="module")
def expected(model):
    """The reference decoder's output per (prompt, params), computed once for both engines."""
    memo = {}

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params)
        if key not in memo:
            memo[key] = reference_greedy(model, prompt, MAX_NEW, reference(prompt, params))
        return memo[key]

    return run


@pytest.mark.parametrize("mtp", ["off", 2])
def test_greedy_with_penalties_equals_the_reference(model, expected, mtp):
    engine = Engine(model, EngineConfig(block_size=16, kv_cache_bytes=2 * 2**20, max_step_tokens=128, mtp=mtp))
    ps = prompts(len(CASES) + 1, seed=17, min_len=4, max_len=30)
    params = [*CASES.values(), SamplingParams(max_tokens=MAX_NEW, temperature=0.0)]  # a free one too
    reqs = engine.generate(ps, params)
    for p, sp, r in zip(ps, params, reqs, strict=True):
        assert r.output_ids == expected(p, sp), sp
    free = [expected(p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0)) for p in ps[:-1]]
    assert all(r.output_ids != f for r, f in zip(reqs, free, strict=False)), "each case changed the output"
    if mtp != "off":
        assert engine.stats.draft_tokens > 0


FAVOURITE = 5  # the token the scripted head favours by +1000 at every position (main and MTP)


@pytest.fixture(scope="module")
def favouring_model(model):
    """The model with its shared lm_head scripted: token FAVOURITE's logit is 1000 above what it
    would be, so without a ban it wins every position (a -100 bias cannot take that back)."""
    scripted = copy.deepcopy(model)
    head = nn.Linear(scripted.lm_head.in_features, scripted.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(scripted.lm_head.weight)
        head.bias.zero_()
        head.bias[FAVOURITE] = 1000.0
    scripted.lm_head = head
    return scripted.eval()


def _masked(token: int):
    def process(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        logits[token] = -math.inf
        return logits
    return process


@pytest.mark.parametrize("mtp", ["off", 2])
def test_a_banned_token_never_comes_out(favouring_model, mtp):
    """The ban beats the client's +100 bias and a logit 1000 above the rest, in sampling and in
    MTP drafting / verification; the old way (-100 bias) still lets the token through."""
    engine = Engine(favouring_model, EngineConfig(block_size=16, kv_cache_bytes=2 * 2**20, max_step_tokens=128,
                                                  mtp=mtp))
    ps = prompts(3, seed=5, min_len=4, max_len=20)
    banned = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, banned_token_ids=(FAVOURITE,),
                            logit_bias={FAVOURITE: 100.0})
    sampled = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=3, banned_token_ids=(FAVOURITE,))
    biased = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias={FAVOURITE: -100.0})
    reqs = engine.generate(ps, [banned, sampled, biased])
    assert FAVOURITE not in reqs[0].output_ids + reqs[1].output_ids
    assert reqs[0].output_ids == reference_greedy(favouring_model, ps[0], MAX_NEW, _masked(FAVOURITE))
    assert reqs[2].output_ids[0] == FAVOURITE, "a bias alone does not ban"
    if mtp != "off":
        assert engine.stats.draft_tokens > 0


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    for min_p, temperature in ((0.05, 1.0), (0.3, 0.7), (0.9, 1.5)):
        probs = processed_probs(logits, [SamplingParams(temperature=temperature, min_p=min_p)] * 3)
        for row, got in zip(logits.tolist(), probs, strict=True):
            scaled = [math.exp(x / temperature) for x in row]
            top = max(scaled)
            kept = [p if p >= min_p * top else 0.0 for p in scaled]
            expected = torch.tensor([p / sum(kept) for p in kept])
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
