"""The tool-use evaluation of the bundled model (tools/tool_use_eval.py on the fixed, hand-written asks of
tools/tool_use_asks.json): the asks are not training asks, the scoring counts calls and checks schemas,
and its batched greedy decoding is plain greedy decoding. The rates the model must reach are checked
with the model retrained for them (MODEL_CARD.md)."""

from __future__ import annotations

import json
import random
import re

from glmserve.model.greedy import greedy_generate
from tools import tiny_corpus
from tools.tool_use_eval import (
    ASKS,
    Run,
    ToolUseReport,
    batched_greedy,
    load_runs,
    prompt_ids,
)


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).strip()


def test_no_evaluation_ask_is_a_training_ask():
    asks = {_norm(c["ask"]) for c in json.loads(ASKS.read_text())["cases"]}
    pool = tiny_corpus.SourcePool(1500, 0)
    for i in range(1500):
        messages, _ = tiny_corpus._transcript(pool, random.Random(f"0:{i}"), tiny_corpus.Mix())
        said = {_norm(m["content"]) for m in messages if m["role"] == "user"}
        assert not asks & said, f"transcript {i} asks {asks & said}"


def test_scoring_counts_calls_and_checks_schemas():
    data = json.loads(ASKS.read_text())
    tools = [data["tools"]["read_file"], data["tools"]["set_timer"]]
    tool_case = {"ask": "x", "needs_tool": True, "expect": {"name": "set_timer", "args": {"minutes": 7}}}
    plain_case = {"ask": "y", "needs_tool": False}
    good = "<tool_call>set_timer<arg_key>minutes</arg_key><arg_value>7</arg_value></tool_call>"
    wrong_type = "<tool_call>set_timer<arg_key>minutes</arg_key><arg_value>soon</arg_value></tool_call>"
    extra_key = "<tool_call>read_file<arg_key>path</arg_key><arg_value>a</arg_value><arg_key>mode</arg_key>" \
                "<arg_value>r</arg_value></tool_call>"
    report = ToolUseReport((
        Run(tool_case, "", tools, good),
        Run(tool_case, "sys", tools, "I would rather not."),
        Run(plain_case, "", tools, wrong_type),
        Run(plain_case, "sys", tools, extra_key + "<tool_call>unclosed"),
    ))
    rates = report.rates()
    assert rates["tool_asks_called"] == 0.5 and rates["plain_asks_called"] == 1.0
    assert rates["tool_asks_called_with_system"] == 0.0 and rates["tool_asks_called_without_system"] == 1.0
    assert rates["valid_free_calls"] == 1 / 4  # 4 attempts (the unclosed one counts), only `good` is valid
    assert rates["right_tool"] == rates["expected_arguments"] == 0.5


def test_batched_greedy_is_greedy(bundled_model, bundled_tokenizer):
    model, tokenizer = bundled_model, bundled_tokenizer
    runs = load_runs()
    prompts = [prompt_ids(r, tokenizer) for r in (runs[0], runs[-1])]  # different lengths, one has a system prompt
    stops = list(tokenizer.eos_token_ids)
    together = batched_greedy(model, prompts, 8, stops)
    assert together == [greedy_generate(model, p, 8, stop_ids=stops) for p in prompts]
