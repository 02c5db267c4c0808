"""Grammars on the bundled tokenizer: whatever the logits, masked sampling yields output that parses
and validates (JSON schemas, GLM tool calls); special tokens never land inside a JSON string or an
argument value; drafts roll back exactly; a matcher rebuilt from the tokens is the one that
generated them; reasoning comes before the grammar; compiled grammars are cached per spec."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from glmserve.core.grammar_spec import GrammarSpec
from glmserve.engine.grammar_cache import GrammarCache
from glmserve.engine.grammar_matcher import RequestGrammar, apply_masks
from glmserve.engine.grammar_tokens import pack_bits, unpack_bits
from glmserve.text.special_tokens import THINK_END, THINK_START, TOOL_CALL_START
from glmserve.text.tokenizer import Tokenizer
from glmserve.text.tool_calls import parse_tool_calls

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "glm52-tiny"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "set_timer", "parameters": {
        "type": "object", "properties": {"minutes": {"type": "integer"}}, "required": ["minutes"]}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "note": {"type": "string", "maxLength": 8}}, "required": ["city"]}}},
]
JSON_SPEC = GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def cache(tokenizer):
    return GrammarCache(tokenizer)


def grammar_of(cache: GrammarCache, spec: GrammarSpec, output=()) -> RequestGrammar:
    return RequestGrammar.from_tokens(cache.get(spec), spec, cache.tokens, list(output))


def _sample(grammar: RequestGrammar, vocab: int, seed: int, limit: int = 300, boost: dict[int, float] | None = None):
    """Random logits, masked: the worst a model could do inside the grammar (``boost`` favours
    some tokens, e.g. special ones, to probe that the mask keeps them out)."""
    g = torch.Generator().manual_seed(seed)
    out, mask = [], torch.empty(1, grammar.num_words, dtype=torch.int32)
    while not grammar.terminated and len(out) < limit:
        logits = torch.randn(1, vocab, generator=g)
        for t, b in (boost or {}).items():
            logits[0, t] += b
        grammar.fill(mask)
        apply_masks(logits, mask)
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g))
        assert grammar.accept(token)
        out.append(token)
    return out


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    return tokenizer.decode([t for t in ids if t not in tokenizer.eos_token_ids])


def _special_boost(tokenizer: Tokenizer) -> dict[int, float]:
    return {t: 4.0 for t in tokenizer.special_ids if t not in tokenizer.eos_token_ids}


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates_and_holds_no_special_token(cache, tokenizer, seed):
    ids = _sample(grammar_of(cache, JSON_SPEC), tokenizer.vocab_size, seed, boost=_special_boost(tokenizer))
    assert ids[-1] in tokenizer.eos_token_ids  # finished inside the limit
    assert not set(ids[:-1]) & tokenizer.special_ids
    jsonschema.validate(json.loads(_text(tokenizer, ids)), SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_parse_and_validate(cache, tokenizer, choice):
    spec = GrammarSpec.from_tool_choice(TOOLS, choice, parallel_tool_calls=False)
    call_start = tokenizer.token_to_id(TOOL_CALL_START)
    for seed in range(3):
        ids = _sample(grammar_of(cache, spec), tokenizer.vocab_size, seed, boost=_special_boost(tokenizer))
        assert ids[0] == call_start  # the tag is the special token, not its spelling
        calls = parse_tool_calls(_text(tokenizer, ids), tools=TOOLS, strip_values=True).tool_calls
        assert len(calls) == 1, _text(tokenizer, ids)
        name, args = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
        if isinstance(choice, dict):
            assert name == "get_weather"
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(args, schema)


def test_special_tokens_banned_inside_values_and_strings(cache, tokenizer):
    tid = tokenizer.token_to_id
    inside_value = [tid("<tool_call>"), *tokenizer.encode("get_weather"), tid("<arg_key>"), *tokenizer.encode("city"),
                    tid("</arg_key>"), tid("<arg_value>"), *tokenizer.encode("Paris")]
    spec = GrammarSpec.from_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    allowed = grammar_of(cache, spec, inside_value).allowed()
    assert [t for t in tokenizer.special_ids if allowed[t]] == [tid("</arg_value>")]
    allowed = grammar_of(cache, JSON_SPEC, tokenizer.encode('{"city": "Pa')).allowed()
    assert not [t for t in tokenizer.special_ids if allowed[t]]
    # A tag spelled with ordinary tokens closes its region as the special token would (the
    # parser reads text): after a spelled `</arg_value></tool_call>` only the stop tokens are left.
    spelled = [b for piece in ("</", "arg_value>", "</", "tool_call>") for b in tokenizer.encode(piece)]
    assert tid("</arg_value>") not in spelled
    allowed = grammar_of(cache, spec, inside_value + spelled).allowed()
    assert allowed.nonzero().flatten().tolist() == sorted(tokenizer.eos_token_ids)


def test_draft_masks_rollback_and_rebuild(cache, tokenizer):
    spec = GrammarSpec("json_object")
    vocab = tokenizer.vocab_size
    ids = _sample(grammar_of(cache, spec), vocab, seed=7)
    assert len(ids) > 12
    grammar = grammar_of(cache, spec, ids[:5])
    before = grammar.allowed()
    # Drafting: each draft under the mask after the previous ones; verification gets every mask.
    for j, t in enumerate(ids[5:9]):
        grammar.draft_mask(j)
        assert grammar.add_draft(t)
    masks = grammar.verify_masks(ids[5:9])
    assert torch.equal(grammar.allowed(), before) and grammar.num_accepted == 5  # drafts taken back
    for j in range(5):
        assert torch.equal(unpack_bits(masks[j], vocab), grammar_of(cache, spec, ids[: 5 + j]).allowed())
    # Drafts the scheduler dropped are taken back on the next call; fresh masks agree.
    grammar.draft_mask(0)
    grammar.add_draft(ids[5])
    assert torch.equal(grammar.verify_masks(ids[5:9]), masks)
    # A draft the grammar rejects: masks after it allow everything (verification rejects there).
    bad = grammar.verify_masks([ids[5], tokenizer.eos_token_ids[0], ids[7]])
    assert not unpack_bits(bad[1], vocab)[tokenizer.eos_token_ids[0]] and bool((bad[2:] == -1).all())
    assert grammar.num_accepted == 5
    with pytest.raises(ValueError, match="tokens"):
        grammar_of(cache, spec, ids[:5] + [tokenizer.eos_token_ids[0]])
    # The stop token itself rolls back: the grammar is open again.
    ids = _sample(grammar_of(cache, JSON_SPEC), vocab, seed=0)
    done = grammar_of(cache, JSON_SPEC, ids)
    assert done.terminated
    done.rollback(1)
    assert not done.terminated and torch.equal(done.allowed(), grammar_of(cache, JSON_SPEC, ids[:-1]).allowed())


@pytest.mark.parametrize("mode", ["enabled", "auto"])
def test_grammar_starts_after_reasoning(cache, tokenizer, mode):
    think, end = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
    spec = JSON_SPEC.with_reasoning(mode)
    prefix = ([think] if mode == "auto" else []) + tokenizer.encode("let me see")
    grammar = grammar_of(cache, spec, prefix)
    allowed = grammar.allowed()
    assert allowed[end] and allowed[tokenizer.encode("}")[0]]  # free text, and the way out
    assert not [t for t in tokenizer.special_ids if allowed[t] and t != end]  # no stop, no tags
    assert grammar.accept(end)
    assert torch.equal(grammar.allowed(), grammar_of(cache, JSON_SPEC).allowed())  # the grammar, from its start
    grammar.rollback(1)
    assert torch.equal(grammar.allowed(), allowed)
    if mode == "auto":  # no reasoning block: the grammar from the first token
        first = grammar_of(cache, spec).allowed()
        assert first[think] and torch.equal(first & ~torch.nn.functional.one_hot(
            torch.tensor(think), tokenizer.vocab_size).bool(), grammar_of(cache, JSON_SPEC).allowed())


def test_pack_bits_round_trip():
    allowed = torch.rand(100, generator=torch.Generator().manual_seed(0)) > 0.5
    allowed[31] = allowed[63] = True  # the sign bit of a word
    assert torch.equal(unpack_bits(pack_bits(allowed), 100), allowed)


def test_specs_and_cache(cache):
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    assert GrammarSpec.from_tool_choice(TOOLS, "auto") is None and GrammarSpec.from_tool_choice(TOOLS, "none") is None
    a = GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {"schema": {"b": 1, "a": 2}}})
    b = GrammarSpec.from_response_format({"type": "json_schema", "json_schema": {"schema": {"a": 2, "b": 1}}})
    assert a.key != b.key and a.key == a.with_reasoning("auto").key  # property order matters, reasoning not
    hits = cache.hits
    cache.get(GrammarSpec("json_object"))
    cache.get(GrammarSpec("json_object"))
    assert cache.hits >= hits + 1
    with pytest.raises(ValueError, match="tool_choice.function.name"):
        GrammarSpec.from_tool_choice(TOOLS, {"type": "function", "function": {"name": "read_file"}})
    with pytest.raises(ValueError, match="response_format.type"):
        GrammarSpec.from_response_format({"type": "yaml"})
    with pytest.raises(ValueError, match="response_format.json_schema.schema"):
        cache.get(GrammarSpec("json_schema", schema='{"type": "no-such-type"}'))
