"""Reasoning: where the output starts (read from the rendered prompt), the split of `<think>` blocks
into reasoning and content (streaming == one-shot for every split), and the chat template's
``enable_thinking`` and ``reasoning_content`` rendering."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from glmserve.text.chat import render_chat
from glmserve.text.reasoning_parser import ReasoningDelta, ReasoningParser, parse_reasoning, reasoning_start
from glmserve.text.tokenizer import Tokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "glm52-tiny"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(BUNDLED)


def _stream(text: str, cuts: list[int], start: str) -> ReasoningDelta:
    parser, out = ReasoningParser(start), ReasoningDelta()
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for part in [parser.feed(p) for p in pieces] + [parser.finish()]:
        out.reasoning += part.reasoning
        out.content += part.content
    return out


CASES = [
    ("none", "\n<think>\nLet me see: 2 + 2.\n</think>\n\nIt is 4.", ("Let me see: 2 + 2.", "It is 4.")),
    ("none", "  It is 4. <think>not reasoning</think>", ("", "  It is 4. <think>not reasoning</think>")),
    ("none", "<thinking is a word", ("", "<thinking is a word")),
    ("none", " <thi", ("", " <thi")),  # a tag that never completed is content
    ("open", "step one\n step two  </think>  answer <think>x</think>", ("step one\n step two",
                                                                        "answer <think>x</think>")),
    ("open", "cut short by max_tokens </thi", ("cut short by max_tokens </thi", "")),
    ("open", "</think>{\"a\": 1}", ("", "{\"a\": 1}")),
    ("closed", "<think>ignored</think> all content", ("", "<think>ignored</think> all content")),
    ("none", "<think></think>", ("", "")),
]


@pytest.mark.parametrize(("start", "text", "want"), CASES)
def test_streaming_matches_one_shot_for_every_split(start, text, want):
    whole = parse_reasoning(text, start)
    assert (whole.reasoning, whole.content) == want
    assert _stream(text, list(range(1, len(text))), start) == whole
    for cut in range(1, len(text)):
        assert _stream(text, [cut], start) == whole
    rng = random.Random(0)
    for _ in range(30):
        assert _stream(text, sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1))), start) == whole


def test_nothing_is_streamed_before_it_is_known():
    p = ReasoningParser("none")
    assert p.feed("\n") == ReasoningDelta()  # could still be whitespace before <think>
    assert p.feed("<think>") == ReasoningDelta()
    assert p.feed(" a </th") == ReasoningDelta("a")
    assert p.feed("ink>") == ReasoningDelta()
    assert p.feed("\nb") == ReasoningDelta("", "b")


@pytest.mark.parametrize(("kwargs", "want"), [({}, "none"), ({"enable_thinking": True}, "open"),
                                              ({"enable_thinking": False}, "closed")])
def test_the_prompt_says_where_the_output_starts(tokenizer, kwargs, want):
    history = [*USER, {"role": "assistant", "content": "4", "reasoning_content": "2+2"}, *USER]
    for messages in (USER, history):
        ids = tokenizer.apply_chat_template(messages, template_kwargs=kwargs)
        assert reasoning_start(ids, tokenizer) == want


def test_unset_enable_thinking_renders_the_prompt_as_before():
    assert render_chat(USER) == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"
    assert render_chat(USER, template_kwargs={"enable_thinking": False}).endswith("<|assistant|>\n<think></think>\n")
    assert render_chat(USER, template_kwargs={"enable_thinking": True}).endswith("<|assistant|>\n<think>")


def test_reasoning_of_earlier_turns_renders_only_after_the_last_user_message():
    turn = {"role": "assistant", "content": "Let me look.", "reasoning_content": " need the file \n",
            "tool_calls": [{"function": {"name": "ls", "arguments": "{}"}}]}
    agentic = render_chat([*USER, turn, {"role": "tool", "content": "a.py"}])
    assert "<|assistant|>\n<think>need the file</think>\nLet me look.<tool_call>ls</tool_call>" in agentic
    later = render_chat([*USER, turn, {"role": "tool", "content": "a.py"}, *USER])
    assert "<think>" not in later and "<|assistant|>\nLet me look.<tool_call>ls" in later


def test_template_kwargs_cannot_replace_what_the_server_sets():
    with pytest.raises(ValueError, match="chat_template_kwargs: 'messages'"):
        render_chat(USER, template_kwargs={"messages": []})
    assert "custom" not in render_chat(USER, template_kwargs={"custom": "x"})  # unknown names are ignored


@pytest.mark.parametrize("start", ["none", "open", "closed"])
def test_random_tags_stream_as_they_parse_whole(start):
    rng = random.Random(start)
    soup = ["<think>", "</think>", " ", "\n", "a", "bc", "<thi", "</th", "<", "ü"]
    for _ in range(100):
        text = "".join(rng.choice(soup) for _ in range(rng.randint(1, 12)))
        whole = parse_reasoning(text, start)
        assert _stream(text, list(range(1, len(text))), start) == whole, text
        if len(text) > 2:
            assert _stream(text, sorted(rng.sample(range(1, len(text)), 2)), start) == whole, text
