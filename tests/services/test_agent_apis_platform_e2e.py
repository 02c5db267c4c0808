"""The agent APIs on the real platform (`glmserve serve`: kvstore, prefill and decode workers over
gRPC, the router with ``--kvstore``): a Responses conversation continued through
``previous_response_id`` (its record kept in the kvstore) gives chat completions' greedy text for
the same conversation, reads the first turn's KV from the prefix cache, and a Messages request
gives the same text as chat."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.serve_platform import ServePlatform
from tests.shared import HAS_MODEL, MODEL_DIR
from tools import tiny_corpus

MODEL = MODEL_DIR.name
SYSTEM = tiny_corpus.SYSTEM_PROMPTS[0] + "\n" + " ".join(["Answer plainly and briefly."] * 24)  # full KV blocks
GREEDY = {"temperature": 0}
MAX_TOKENS = 16

pytestmark = [pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing"), pytest.mark.slow]


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    served = ServePlatform(tmp_path_factory.mktemp("agent") / "serve.log", "--host-tier-bytes", "0",
                           env={"OMP_NUM_THREADS": "1"})
    try:
        served.wait_serving()
        yield served
    finally:
        served.stop()


def test_a_conversation_over_the_platform(platform):
    oai = openai.OpenAI(base_url=f"{platform.url}/v1", api_key="unused", max_retries=0, timeout=300)
    first = oai.responses.create(model=MODEL, instructions=SYSTEM, input="What is a linked list?",
                                 max_output_tokens=MAX_TOKENS, user="agent-1", **GREEDY)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a linked list?"}]
    chat = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=MAX_TOKENS, **GREEDY)
    assert first.output_text == chat.choices[0].message.content

    history += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And a tree?"}]
    second = oai.responses.create(model=MODEL, instructions=SYSTEM, input="And a tree?", user="agent-1",
                                  previous_response_id=first.id, max_output_tokens=MAX_TOKENS, **GREEDY)
    chat = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=MAX_TOKENS, **GREEDY)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's blocks
    assert oai.responses.retrieve(second.id).output_text == second.output_text  # from the kvstore

    claude = anthropic.Anthropic(base_url=platform.url, api_key="unused", max_retries=0, timeout=300)
    message = claude.messages.create(model=MODEL, system=SYSTEM, messages=history[1:], max_tokens=MAX_TOKENS,
                                     extra_body=GREEDY)  # this client sends sampling fields only so
    assert "".join(b.text for b in message.content if b.type == "text") == chat.choices[0].message.content
    assert message.usage.cache_read_input_tokens > 0
