"""``/v1/responses`` and ``/v1/messages`` end to end with the unmodified `openai` and `anthropic`
clients: uvicorn on 127.0.0.1, the bundled model in a LocalEngineBackend (as serve-local runs it).
Greedy text and tool calls equal chat completions' for the same conversation, whole and streamed;
a second turn reads the first one's KV from the prefix cache (the usage says so)."""

from __future__ import annotations

import json

import openai
import pytest
from router_fixtures import HAS_MODEL, MODEL_DIR, serve

from glmserve.services.local_backend import LocalEngineBackend
from glmserve.services.router.app import create_app
from glmserve.text.tokenizer import Tokenizer
from tools import tiny_corpus

anthropic = pytest.importorskip("anthropic")

MODEL = "glm52-tiny"
TOOLS = [tiny_corpus.TOOLS[name] for name in ("read_file", "list_dir")]
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
SYSTEM = tiny_corpus.SYSTEM_PROMPTS[0]
LONG_SYSTEM = SYSTEM + "\n" + " ".join(["Answer plainly and briefly."] * 24)  # a few full KV blocks
ASKS = ["Read the file setup.py", "What is a linked list?"]
MAX_TOKENS = 24
GREEDY = {"temperature": 0}  # the anthropic client sends sampling fields only as extra_body

pytestmark = [pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing"), pytest.mark.slow]


@pytest.fixture(scope="module")
def base():
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    backend = LocalEngineBackend.from_model_dir(MODEL_DIR)
    with serve(create_app(backend, tokenizer, MODEL, max_context=2048)) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(base):
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300)


def _chat(oai, messages):
    """(text, [(name, arguments)]) of greedy chat completions."""
    message = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=MAX_TOKENS).choices[0].message
    return message.content or "", [(c.function.name, json.loads(c.function.arguments))
                                   for c in message.tool_calls or []]


def _response(resp):
    calls = [(i.name, json.loads(i.arguments)) for i in resp.output if i.type == "function_call"]
    return resp.output_text, calls


def _message(msg):
    text = "".join(b.text for b in msg.content if b.type == "text")
    return text, [(b.name, b.input) for b in msg.content if b.type == "tool_use"]


@pytest.mark.parametrize("ask", ASKS)
def test_greedy_answers_equal_chat_completions(oai, claude, ask):
    expected = _chat(oai, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}])
    kwargs = {"model": MODEL, "instructions": SYSTEM, "input": ask, "tools": FLAT_TOOLS, "temperature": 0,
              "max_output_tokens": MAX_TOKENS}
    assert _response(oai.responses.create(**kwargs)) == expected
    streamed = list(oai.responses.create(stream=True, **kwargs))
    assert _response(streamed[-1].response) == expected
    message_kwargs = {"model": MODEL, "system": SYSTEM, "messages": [{"role": "user", "content": ask}],
                      "tools": ANTHROPIC_TOOLS, "extra_body": GREEDY, "max_tokens": MAX_TOKENS}
    assert _message(claude.messages.create(**message_kwargs)) == expected
    with claude.messages.stream(**message_kwargs) as stream:
        assert _message(stream.get_final_message()) == expected


def test_a_second_turn_reads_the_prefix_cache(oai, claude):
    first = oai.responses.create(model=MODEL, instructions=LONG_SYSTEM, input=ASKS[1], temperature=0,
                                 max_output_tokens=MAX_TOKENS)
    second = oai.responses.create(model=MODEL, instructions=LONG_SYSTEM, input="Thanks. And a tree?", temperature=0,
                                  max_output_tokens=MAX_TOKENS, previous_response_id=first.id)
    history = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": ASKS[1]},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Thanks. And a tree?"}]
    chat = oai.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=MAX_TOKENS)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    messages = [{"role": "user", "content": ASKS[1]}]
    claude.messages.create(model=MODEL, system=LONG_SYSTEM, messages=messages, extra_body=GREEDY, max_tokens=MAX_TOKENS)
    again = claude.messages.create(model=MODEL, system=LONG_SYSTEM, messages=messages, extra_body=GREEDY,
                                   max_tokens=MAX_TOKENS)
    assert again.usage.cache_read_input_tokens > 0
    prompt = Tokenizer.from_dir(MODEL_DIR).apply_chat_template(history[:2])
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(prompt)
