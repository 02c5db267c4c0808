"""Reasoning through the agent APIs with the real `openai` and `anthropic` clients over a scripted
backend: a `<think>` block becomes a Responses ``reasoning`` item and an Anthropic ``thinking``
block (whole, streamed, and through each client's stream accumulator); in a tool loop the next
prompt carries it back where the chat template shows it, so that prompt still starts with what the
model wrote (its KV is reused); ``reasoning.effort`` / ``thinking`` reach ``enable_thinking``."""

from __future__ import annotations

import anthropic
import openai
import pytest
from router_fixtures import HAS_MODEL, MODEL_DIR, ScriptedBackend, serve

from glmserve.services.router.app import create_app
from glmserve.text.tokenizer import Tokenizer

MODEL = "glm52-tiny"
OUTPUT = "<think>I need the file.</think>\nLet me look.<tool_call>read_file<arg_key>path</arg_key>" \
         "<arg_value>a.py</arg_value></tool_call>"
TOOL = {"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}

pytestmark = pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing")


@pytest.fixture(scope="module")
def served():
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    done, call = tokenizer.encode("It says hi."), tokenizer.encode(OUTPUT)
    backend = ScriptedBackend(lambda p: done if "<tool_response>" in tokenizer.decode(p) else call, tokenizer)
    with serve(create_app(backend, tokenizer, MODEL, max_context=4096)) as url:
        yield backend, tokenizer, url


def _continues(backend, tokenizer, first_prompt: list[int]) -> None:
    """The last prompt starts with the first one and the model's whole output, think block included."""
    assert tokenizer.decode(backend.generated[-1][1]).startswith(tokenizer.decode(first_prompt) + OUTPUT)


def test_responses_reasoning_item_and_the_tool_loop(served):
    backend, tokenizer, url = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "name": TOOL["name"], "parameters": TOOL["input_schema"]}
    first = client.responses.create(model=MODEL, input="read a.py", tools=[tool])
    assert [i.type for i in first.output] == ["reasoning", "message", "function_call"]
    assert first.output[0].content[0].text == "I need the file." and first.output_text == "Let me look."
    first_prompt = backend.generated[-1][1]
    with client.responses.stream(model=MODEL, input="read a.py", tools=[tool]) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and streamed.output[0].content[0].text == "I need the file."
    call = first.output[2]
    second = client.responses.create(model=MODEL, tools=[tool], previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "hi"}])
    assert second.output_text == "It says hi."
    _continues(backend, tokenizer, first_prompt)
    # A client that keeps its own history sends the reasoning item back: the same prompt.
    again = backend.generated[-1][1]
    client.responses.create(model=MODEL, tools=[tool], store=False, input=[
        {"role": "user", "content": "read a.py"}, *[i.model_dump(exclude_none=True) for i in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "hi"}])
    assert backend.generated[-1][1] == again
    for effort, ending in (("none", "<think></think>\n"), ("high", "<think>")):
        client.responses.create(model=MODEL, input="read a.py", reasoning={"effort": effort})
        assert tokenizer.decode(backend.generated[-1][1]).endswith("<|assistant|>\n" + ending)


def test_messages_thinking_block_and_the_tool_loop(served):
    backend, tokenizer, url = served
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    kwargs = {"model": MODEL, "max_tokens": 100, "tools": [TOOL],
              "messages": [{"role": "user", "content": "read a.py"}]}
    first = client.messages.create(**kwargs)
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert first.content[0].thinking == "I need the file." and first.stop_reason == "tool_use"
    first_prompt = backend.generated[-1][1]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content][:2] == [b.model_dump() for b in first.content][:2]
    use = first.content[2]
    second = client.messages.create(**{**kwargs, "messages": kwargs["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hi"}]}]})
    assert second.content[0].text == "It says hi."
    _continues(backend, tokenizer, first_prompt)
    for thinking, ending in (({"type": "disabled"}, "<think></think>\n"),
                             ({"type": "enabled", "budget_tokens": 1024}, "<think>")):
        client.messages.create(**kwargs, thinking=thinking)
        assert tokenizer.decode(backend.generated[-1][1]).endswith("<|assistant|>\n" + ending)
        counted = client.messages.count_tokens(model=MODEL, messages=kwargs["messages"], tools=[TOOL],
                                               thinking=thinking)
        assert counted.input_tokens == len(backend.generated[-1][1])
