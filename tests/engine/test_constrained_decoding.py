"""Grammar-constrained decoding in the engine: greedy output with a grammar equals a plain greedy
decoder that masks each step by a fresh matcher, with and without MTP drafts, batched with free
requests, under preemption and across prefill -> decode; reasoning before the grammar is the
unconstrained greedy path up to `</think>`; sampled output always parses."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from constrained_fixtures import bundled_tokenizer, reference_greedy, vocab_model
from engine_fixtures import prompts

from glmserve.core.generation import SamplingParams
from glmserve.core.grammar_spec import GrammarSpec
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.engine.grammar_cache import GrammarCache
from glmserve.engine.grammar_matcher import RequestGrammar, apply_masks
from glmserve.engine.handoff import PrefillOutput
from glmserve.text.tool_calls import parse_tool_calls

MAX_NEW = 64
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"}},
          "required": ["name", "size"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {
    "type": "object", "properties": {"pattern": {"type": "string", "maxLength": 5}, "glob": {"enum": ["*.py", "*.md"]}},
    "required": ["pattern", "glob"]}}}]
SPECS = {
    "schema": GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
    "object": GrammarSpec("json_object"),
    "tools": GrammarSpec.from_tool_choice(TOOLS, "required", parallel_tool_calls=False),
}


@pytest.fixture(scope="module")
def tokenizer():
    return bundled_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return vocab_model(tokenizer, seed=3)


@pytest.fixture(scope="module")
def cache(tokenizer):
    return GrammarCache(tokenizer)


@pytest.fixture(scope="module")
def oracle(model, cache):
    """Greedy, one token at a time, each step masked by a matcher rebuilt from the output so far."""
    memo = {}

    def run(prompt, spec):
        key = (tuple(prompt), spec.key)
        if key not in memo:
            def mask(logits, out):
                grammar = RequestGrammar.from_tokens(cache.get(spec), spec, cache.tokens, out)
                rows = torch.empty(1, grammar.num_words, dtype=torch.int32)
                grammar.fill(rows)
                x = logits.view(1, -1)
                apply_masks(x, rows)
                return x[0]
            memo[key] = reference_greedy(model, prompt, MAX_NEW, mask)
        return memo[key]

    return run


def _engine(model, tokenizer, cache, **overrides) -> Engine:
    config = dict(block_size=16, kv_cache_bytes=4 * 2**20, max_step_tokens=256)
    return Engine(model, EngineConfig(**{**config, **overrides}), tokenizer=tokenizer, grammars=cache)


def _valid(tokenizer, name: str, ids: list[int]) -> None:
    assert ids[-1] in tokenizer.eos_token_ids, "finished by the grammar's stop token"
    text = tokenizer.decode(ids[:-1])
    if name == "tools":
        calls = parse_tool_calls(text, TOOLS, strip_values=True).tool_calls
        assert len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), TOOLS[0]["function"]["parameters"])
    else:
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA if name == "schema" else {"type": "object"})


@pytest.mark.parametrize("mtp", ["off", 2])
def test_greedy_with_grammar_equals_plain_masked_greedy(model, tokenizer, cache, oracle, mtp):
    engine = _engine(model, tokenizer, cache, mtp=mtp)
    ps = prompts(4, seed=7, min_len=5, max_len=40)
    names = ["schema", "tools", None, "schema"]  # a free request in the same batch
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, grammar=SPECS.get(n)) for n in names]
    reqs = engine.generate(ps, params)
    for p, name, r in zip(ps, names, reqs, strict=True):
        if name is None:
            continue
        assert r.output_ids == oracle(p, SPECS[name])
        if r.finish_reason == "stop":
            _valid(tokenizer, name, r.output_ids)
    if mtp != "off":
        assert engine.stats.draft_tokens > 0
    assert sum(r.finish_reason == "stop" for r, n in zip(reqs, names, strict=True) if n) >= 2


THINK_BIAS = 2.25  # on `</think>`: the random model then closes its reasoning after 9 and 12 tokens
REASONING_SPEC = SPECS["schema"].with_reasoning("enabled")


@pytest.fixture(scope="module")
def reasoning_refs(model, tokenizer, cache):
    """Per prompt: the greedy output without a grammar (same bias), and the fresh-matcher oracle's
    with the grammar after `</think>` (computed once for both engines)."""
    think_end, spec = tokenizer.token_to_id("</think>"), REASONING_SPEC

    def biased(logits, out):
        logits[think_end] += THINK_BIAS
        return logits

    def constrained(logits, out):
        grammar = RequestGrammar.from_tokens(cache.get(spec), spec, cache.tokens, out)
        rows = torch.empty(1, grammar.num_words, dtype=torch.int32)
        grammar.fill(rows)
        x = biased(logits, out).view(1, -1)
        apply_masks(x, rows)
        return x[0]

    ps = prompts(6, seed=21, min_len=5, max_len=30)[3:5]
    return [(p, reference_greedy(model, p, MAX_NEW, biased), reference_greedy(model, p, MAX_NEW, constrained))
            for p in ps]


@pytest.mark.parametrize("mtp", ["off", 2])
def test_reasoning_then_grammar_is_the_unconstrained_path_then_the_grammar(model, tokenizer, cache, reasoning_refs,
                                                                            mtp):
    """The prompt opened `<think>` ("enabled"): up to `</think>` the output is what greedy decoding
    without any grammar writes; after it, the grammar's (the fresh-matcher oracle, MTP or not)."""
    think_end = tokenizer.token_to_id("</think>")
    engine = _engine(model, tokenizer, cache, mtp=mtp)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, grammar=REASONING_SPEC,
                            logit_bias={think_end: THINK_BIAS})
    reqs = engine.generate([p for p, _, _ in reasoning_refs], params)
    for (_, free, oracle), r in zip(reasoning_refs, reqs, strict=True):
        assert r.output_ids == oracle
        n = free.index(think_end) + 1
        assert n > 5 and not set(free[: n - 1]) & tokenizer.special_ids  # plain reasoning text first
        assert r.output_ids[:n] == free[:n]
        if r.finish_reason == "stop":
            _valid(tokenizer, "schema", r.output_ids[n:])
    if mtp != "off":
        assert engine.stats.draft_tokens > 0


@pytest.mark.slow
def test_sampled_output_with_mtp_parses(model, tokenizer, cache):
    engine = _engine(model, tokenizer, cache, mtp=2)
    ps = prompts(6, seed=9, min_len=5, max_len=30)
    names = ["schema", "tools", "schema", "tools", "schema", "tools"]
    params = [SamplingParams(max_tokens=120, temperature=1.0, top_p=0.95, seed=i, grammar=SPECS[n])
              for i, n in enumerate(names)]
    for name, r in zip(names, engine.generate(ps, params), strict=True):
        _valid(tokenizer, name, r.output_ids)
    assert engine.stats.accepted_tokens > 0


@pytest.mark.slow
def test_preemption_keeps_the_grammar(model, tokenizer, cache, oracle):
    small = _engine(model, tokenizer, cache, mtp=1).cache.layout.bytes_per_block * 10
    engine = _engine(model, tokenizer, cache, mtp=2, kv_cache_bytes=small, max_num_seqs=6)
    ps = prompts(5, seed=5, min_len=20, max_len=50)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, grammar=SPECS["schema"])
    reqs = engine.generate(ps, params)
    assert engine.stats.preemptions > 0
    for p, r in zip(ps, reqs, strict=True):
        assert r.output_ids == oracle(p, SPECS["schema"])


@pytest.mark.slow
def test_prefill_then_decode_rebuilds_the_matcher(model, tokenizer, cache, oracle, mtp=2):
    prefill, decode = _engine(model, tokenizer, cache, mtp=mtp), _engine(model, tokenizer, cache, mtp=mtp)
    spec = SPECS["tools"]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, grammar=spec)
    for i, p in enumerate(prompts(2, seed=13, min_len=10, max_len=40)):
        rid = f"r{i}"
        prefill.add_request(rid, p, SamplingParams(max_tokens=1, temperature=0.0, grammar=spec), hold_blocks=True)
        while prefill.has_unfinished():
            prefill.step()
        held = prefill.held_prefill(rid)
        dest = decode.reserve(rid, len(p) + 1)
        n = min(len(dest), len(held.block_ids))  # the prompt's blocks (decode may reserve one more)
        decode.kv_buffer[dest[:n]] = prefill.kv_buffer[held.block_ids[:n]]
        prefill.release(rid)
        event = decode.add_prefilled(rid, p, params, held.output)
        req = decode.requests.get(rid)
        while decode.has_unfinished():
            decode.step()
        out = req.output_ids if req is not None else event.token_ids
        assert out == oracle(p, spec)


def test_bad_grammar_changes_nothing(model, tokenizer, cache):
    engine = _engine(model, tokenizer, cache)
    bad = GrammarSpec("json_schema", schema='{"type": "no-such-type"}')
    with pytest.raises(ValueError, match="response_format.json_schema.schema"):
        engine.add_request("x", [5, 6], SamplingParams(grammar=bad))
    engine.reserve("y", 4)
    with pytest.raises(ValueError, match="response_format"):
        engine.add_prefilled("y", [5, 6], SamplingParams(grammar=bad),
                             PrefillOutput(7, bytes(4 * model.config.hidden_size)))
    assert engine.release("y") and not engine.requests and engine.pool.num_used == 0
    with pytest.raises(ValueError, match="grammar"):
        Engine(model, EngineConfig(block_size=16, kv_cache_bytes=2**20)).add_request(
            "z", [5], SamplingParams(grammar=SPECS["object"]))
