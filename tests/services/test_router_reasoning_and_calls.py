"""Chat answers read for reasoning and tool calls, over a scripted backend with the real `openai`
client: `<think>` blocks become ``reasoning_content`` (its own stream deltas), tool-call arguments
stream in pieces, and the stream the client's accumulation helpers put together equals the
non-streamed message; ``chat_template_kwargs`` reach the template and the grammar's reasoning mode
follows the prompt."""

from __future__ import annotations

import json

import openai
import pytest
from router_fixtures import MODEL_DIR, ScriptedBackend, accumulated_stream, message_parts, serve

from glmserve.services.router.app import create_app
from glmserve.services.router.main import RouterConfig
from glmserve.text.tokenizer import Tokenizer

MODEL = "glm52-tiny"
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "start_line": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object", "properties": {}}}},
]
SCRIPTS = {  # a word in the last user message -> what the model "writes"
    "THINK": "<think>\nThe user greets me.\n</think>\nHello there!",
    "OPEN": "The user greets me.</think>\n\nHello there!",
    "CALLS": "<think>I need the file.</think>Let me look.\n<tool_call>read_file\n<arg_key>path</arg_key>\n"
             "<arg_value>src/app.py</arg_value>\n<arg_key>start_line</arg_key><arg_value>12</arg_value>\n"
             "</tool_call>\n<tool_call>list_dir</tool_call>",
    "JSON": '</think>{"a": 1}',
}


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def scripted():
    tokenizer = Tokenizer.from_dir(MODEL_DIR)

    def script(prompt: list[int]) -> list[int]:
        last = tokenizer.decode(prompt).rsplit("<|user|>", 1)[-1]
        return tokenizer.encode(next(text for word, text in SCRIPTS.items() if word in last))

    backend = ScriptedBackend(script, tokenizer)
    with serve(create_app(backend, tokenizer, MODEL, max_context=4096)) as url:
        yield backend, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), tokenizer


def test_think_block_becomes_reasoning_content(scripted):
    _, client, _ = scripted
    kwargs = {"model": MODEL, "messages": _user("THINK"), "max_tokens": 100}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert message_parts(whole) == {"content": "Hello there!", "reasoning": "The user greets me.", "calls": [],
                               "finish": "stop"}
    streamed, deltas = accumulated_stream(client, **kwargs)
    assert message_parts(streamed) == message_parts(whole)
    kinds = [("reasoning" if getattr(d, "reasoning_content", None) else "content") for d in deltas if
             getattr(d, "reasoning_content", None) or d.content]
    assert kinds[0] == "reasoning" and kinds[-1] == "content" and kinds.count("reasoning") > 1  # its own deltas


def test_enable_thinking_opens_the_block_in_the_prompt(scripted):
    backend, client, tokenizer = scripted
    kwargs = {"model": MODEL, "messages": _user("OPEN"), "max_tokens": 100,
              "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert tokenizer.decode(backend.generated[-1][1]).endswith("<|assistant|>\n<think>")
    assert message_parts(whole) == {"content": "Hello there!", "reasoning": "The user greets me.", "calls": [],
                               "finish": "stop"}
    assert message_parts(accumulated_stream(client, **kwargs)[0]) == message_parts(whole)


def test_separate_reasoning_false_keeps_the_block_in_the_content(scripted):
    _, client, _ = scripted
    out = client.chat.completions.create(model=MODEL, messages=_user("THINK"), max_tokens=100,
                                         extra_body={"separate_reasoning": False}).choices[0]
    assert out.message.content == SCRIPTS["THINK"] and getattr(out.message, "reasoning_content", None) is None


def test_the_router_flag_sets_the_default():
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    backend = ScriptedBackend(lambda _: tokenizer.encode(SCRIPTS["THINK"]), tokenizer)
    with serve(create_app(backend, tokenizer, MODEL, max_context=4096, separate_reasoning=False)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        kept = client.chat.completions.create(model=MODEL, messages=_user("x"), max_tokens=100).choices[0]
        assert kept.message.content == SCRIPTS["THINK"]  # --reasoning-parser none: the block stays
        asked = client.chat.completions.create(model=MODEL, messages=_user("x"), max_tokens=100,
                                               extra_body={"separate_reasoning": True}).choices[0]
        assert (asked.message.content, asked.message.reasoning_content) == ("Hello there!", "The user greets me.")

    assert RouterConfig.from_args(["--model", str(MODEL_DIR), "--decode", "127.0.0.1:1", "--prefill",
                                   "127.0.0.1:2"]).reasoning_parser == "glm45"
    config = RouterConfig.from_args(["--model", str(MODEL_DIR), "--decode", "127.0.0.1:1", "--prefill",
                                     "127.0.0.1:2", "--reasoning-parser", "none"])
    assert config.reasoning_parser == "none"


def test_tool_call_arguments_stream_in_pieces_and_add_up(scripted):
    _, client, _ = scripted
    kwargs = {"model": MODEL, "messages": _user("CALLS"), "tools": TOOLS, "max_tokens": 200}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert message_parts(whole) == {
        "content": "Let me look.", "reasoning": "I need the file.", "finish": "tool_calls",
        "calls": [("read_file", json.dumps({"path": "src/app.py", "start_line": 12})), ("list_dir", "{}")],
    }
    streamed, deltas = accumulated_stream(client, **kwargs)
    assert message_parts(streamed) == message_parts(whole)
    pieces = [tc for d in deltas for tc in d.tool_calls or []]
    first = [tc for tc in pieces if tc.index == 0]
    assert first[0].id and first[0].function.name == "read_file"
    assert len(first) >= 3 and all(tc.id is None and tc.function.name is None for tc in first[1:])
    content_deltas = [d.content for d in deltas if d.content]
    assert "".join(content_deltas) == "Let me look."  # no piece of a call ever showed as content


def test_grammar_starts_after_the_reasoning(scripted):
    backend, client, _ = scripted
    fmt = {"type": "json_object"}
    for kwargs, mode in (({"enable_thinking": True}, "enabled"), ({"enable_thinking": False}, "disabled"),
                         ({}, "auto")):
        out = client.chat.completions.create(model=MODEL, messages=_user("JSON"), response_format=fmt, max_tokens=50,
                                             extra_body={"chat_template_kwargs": kwargs})
        assert backend.generated[-1][2].grammar.reasoning == mode
        if mode == "enabled":
            assert out.choices[0].message.content == '{"a": 1}'
    client.chat.completions.create(model=MODEL, messages=_user("JSON"), response_format=fmt, max_tokens=50,
                                   extra_body={"separate_reasoning": False})
    assert backend.generated[-1][2].grammar.reasoning == "disabled"  # unseparated: JSON from the first token


def test_reasoning_content_of_earlier_turns_and_bad_kwargs(scripted):
    backend, client, tokenizer = scripted
    turns = [*_user("read it"), {"role": "assistant", "content": "Looking.", "reasoning_content": "need it",
                                 "tool_calls": [{"id": "c1", "type": "function",
                                                 "function": {"name": "list_dir", "arguments": "{}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "a.py"}, {"role": "user", "content": "THINK"}]
    client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=5)
    assert "need it" not in tokenizer.decode(backend.generated[-1][1])  # before the last user message: dropped
    with pytest.raises(openai.BadRequestError, match="reasoning_content"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x",
                                                               "reasoning_content": "no"}], max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model=MODEL, messages=_user("THINK"), max_tokens=5,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
