"""The router end to end with the unmodified `openai` client: uvicorn on 127.0.0.1, the bundled
model in a LocalEngineBackend. Greedy decoding everywhere, so answers can be compared exactly."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from logprob_oracle import reference_logprobs
from router_fixtures import HAS_MODEL, MODEL_DIR, ScriptedBackend, serve

from glmserve.engine.logits_processor import LogitsProcessor
from glmserve.engine.request import Request
from glmserve.model.loader import load_model
from glmserve.services.local_backend import LocalEngineBackend
from glmserve.services.router.app import create_app
from glmserve.text.special_tokens import TOOL_MARKUP
from glmserve.text.tokenizer import Tokenizer
from tools import tiny_corpus

MODEL = "glm52-tiny"
KEY = "sk-router-test"
TOOLS = list(tiny_corpus.TOOLS.values())
SYSTEM = tiny_corpus.SYSTEM_PROMPTS[0]
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 6}

pytestmark = pytest.mark.skipif(not HAS_MODEL, reason="bundled model missing")


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def backend():
    return LocalEngineBackend.from_model_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def base(backend, tokenizer):
    max_context = json.loads((MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    app = create_app(backend, tokenizer, MODEL, api_keys=[KEY], max_context=max_context)
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def _engine_idle(backend: LocalEngineBackend, timeout_s: float = 5.0) -> tuple[bool, int]:
    """Poll the engine (on its own thread) until nothing runs and no block is owned."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = backend.call_in_engine(lambda e: (e.has_unfinished(), e.pool.num_used)).result(timeout=30)
        if state == (False, 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


def test_chat_streaming_equals_non_streaming_with_usage(client, tokenizer):
    messages = [{"role": "system", "content": SYSTEM}, *_user("What does json/decoder.py do?")]
    whole = client.chat.completions.create(messages=messages, logprobs=True, **GREEDY)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages))
    assert 1 <= whole.usage.completion_tokens <= GREEDY["max_tokens"]
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(lp.logprob <= 0 for lp in choice.logprobs.content)

    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (choice.message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL_DIR)


def _ids(tokenizer: Tokenizer, spellings: list[bytes]) -> list[int]:
    by_bytes = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    return [by_bytes[b] for b in spellings]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_are_the_models(client, tokenizer, model, stream):
    """Every token's logprob and its top_logprobs equal the model's log_softmax (first token included)."""
    messages = _user("What does json/decoder.py do?")
    kwargs = {**GREEDY, "messages": messages, "logprobs": True, "top_logprobs": 5}
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        entries = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    generated = _ids(tokenizer, [bytes(e.bytes) for e in entries])
    prompt = tokenizer.apply_chat_template(messages)
    expected = reference_logprobs(model, prompt, generated, 5)
    assert len(entries) == len(expected) >= 1
    for entry, ref in zip(entries, expected, strict=True):
        assert entry.logprob == pytest.approx(ref.chosen, abs=1e-3)
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx([lp for _, lp in ref.top], abs=1e-3)
        assert _ids(tokenizer, [bytes(a.bytes) for a in entry.top_logprobs])[0] == ref.top[0][0]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_are_the_models(client, tokenizer, model, stream):
    prompt = tokenizer.encode("def fibonacci(n):")
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3}
    if stream:
        parts = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
                 if c.choices and c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        chosen = [lp for p in parts for lp in p.token_logprobs]
        tops = [t for p in parts for t in p.top_logprobs]
    else:
        lp = client.completions.create(**kwargs).choices[0].logprobs
        tokens, chosen, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    generated = _ids(tokenizer, [t.encode() for t in tokens])
    expected = reference_logprobs(model, prompt, generated, 3)
    assert len(chosen) == len(expected) == len(tops) >= 1
    for value, top, ref in zip(chosen, tops, expected, strict=True):
        assert value == pytest.approx(ref.chosen, abs=1e-3)
        assert 3 <= len(top) <= 4  # the 3 most likely, and the chosen one if it is not among them
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx([v for _, v in ref.top], abs=1e-3)


def test_logprobs_ranges_are_checked(client):
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**GREEDY, messages=_user("x"), logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=6)


def test_repeated_prompt_reports_cached_tokens(client):
    messages = [{"role": "system", "content": SYSTEM + " " + "Answer briefly. " * 40}, *_user("Hello")]
    # max_tokens 2: the engine publishes prompt blocks to the prefix cache after the prefill step.
    client.chat.completions.create(messages=messages, **{**GREEDY, "max_tokens": 2})
    again = client.chat.completions.create(messages=messages, **{**GREEDY, "max_tokens": 2})
    assert again.usage.prompt_tokens > 64
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # at least one full block reused


def test_model_emits_a_parsed_tool_call(client):
    messages = _user("What is in the directory json?")  # the trained model answers with a call (~12 tokens)
    kwargs = {**GREEDY, "max_tokens": 24, "tools": TOOLS, "messages": messages}
    with ThreadPoolExecutor(2) as pool:  # batched together: one pass of decoding for both
        whole_f = pool.submit(client.chat.completions.create, **kwargs)
        stream_f = pool.submit(
            lambda: [d for c in client.chat.completions.create(stream=True, **kwargs) for d in c.choices]
        )
        whole, streamed = whole_f.result(), stream_f.result()
    calls = whole.choices[0].message.tool_calls
    assert calls and whole.choices[0].finish_reason == "tool_calls", whole.choices[0].message
    assert calls[0].function.name in tiny_corpus.TOOLS and calls[0].id.startswith("call_")
    args = json.loads(calls[0].function.arguments)
    first = [tc for d in streamed for tc in d.delta.tool_calls or [] if tc.index == 0]  # in pieces
    name, arguments = first[0].function.name, "".join(tc.function.arguments or "" for tc in first)
    assert (name, json.loads(arguments)) == (calls[0].function.name, args)
    assert streamed[-1].finish_reason == "tool_calls"


def test_completions_and_models(client, tokenizer):
    ids = tokenizer.encode("def main():")
    by_ids = client.completions.create(prompt=ids, **GREEDY)
    by_text = client.completions.create(prompt="def main():", **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_sixteen_concurrent_clients_equal_their_unloaded_runs(client):
    prompts = [f"Explain item {i} of the list in json/{i}.py" for i in range(16)]

    def ask(prompt: str) -> str:
        out = client.chat.completions.create(messages=_user(prompt), **{**GREEDY, "max_tokens": 4})
        return out.choices[0].message.content

    alone = [ask(p) for p in prompts]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


def _aborts(backend: LocalEngineBackend) -> int:
    return backend.call_in_engine(lambda e: e.stats.aborts).result(timeout=30)


def test_closing_a_stream_aborts_the_request(client, backend):
    before = _aborts(backend)
    stream = client.chat.completions.create(
        messages=_user("Tell me a long story."),
        stream=True,
        extra_body={"ignore_eos": True},
        **{**GREEDY, "max_tokens": 2000},
    )
    chunk = next(c for c in stream if c.choices and c.choices[0].delta.content)  # decoding has begun
    assert chunk.choices[0].finish_reason is None
    stream.close()
    assert _engine_idle(backend) == (False, 0)
    assert _aborts(backend) == before + 1


def test_client_timeout_aborts_a_non_streaming_request(base, backend):
    before = _aborts(backend)
    body = {**GREEDY, "max_tokens": 2000, "ignore_eos": True, "messages": _user("Write everything you know.")}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1
        )
    assert _engine_idle(backend) == (False, 0)
    assert _aborts(backend) == before + 1


def test_metrics_are_exposed(base, client):
    client.chat.completions.create(messages=_user("hi"), **GREEDY)
    text = httpx.get(f"{base}/metrics").text
    for name in (
        "glmserve_router_time_to_first_token_seconds_bucket",
        "glmserve_router_inter_token_latency_seconds",
        "glmserve_router_e2e_request_latency_seconds_count",
        'glmserve_router_requests_total{endpoint="chat_completions",model_name=',
        'glmserve_router_request_success_total{finished_reason=',
        "glmserve_router_prompt_tokens_total",
        "glmserve_router_generation_tokens_total",
        "glmserve_router_requests_running",
    ):
        assert name in text


# --- text paths the tiny model cannot be steered into: a scripted backend ------------------------

CALL_TEXT = "Let me look.<tool_call>read_file<arg_key>path</arg_key><arg_value>a.py</arg_value></tool_call>"


class ThreadRecordingTokenizer(Tokenizer):
    """Records which threads tokenize: the server's event loop runs in the `uvicorn-*` thread."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text)


@pytest.fixture(scope="module")
def scripted():
    tokenizer = ThreadRecordingTokenizer.from_dir(MODEL_DIR)
    call, stop = tokenizer.encode(CALL_TEXT), tokenizer.encode("one two STOP three four")
    backend = ScriptedBackend(lambda prompt: call if "SCRIPT-CALL" in tokenizer.decode(prompt) else stop,
                              tokenizer)
    app = create_app(backend, tokenizer, MODEL, max_context=4096)
    with serve(app) as url:
        yield backend, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), tokenizer


def test_tool_call_markup_becomes_tool_calls(scripted):
    _, client, _ = scripted
    kwargs = {"model": MODEL, "messages": _user("SCRIPT-CALL"), "tools": TOOLS, "max_tokens": 100}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.content == "Let me look." and whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("read_file", {"path": "a.py"})
    ]
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me look."
    assert [tc.function.name for d in deltas for tc in d.tool_calls or [] if tc.function.name] == ["read_file"]
    no_tools = client.chat.completions.create(**{**kwargs, "tool_choice": "none"}).choices[0]
    assert no_tools.message.tool_calls is None and no_tools.message.content.startswith(
        "Let me look.read_file"
    )


def test_tool_choice_none_bans_the_markup_whatever_the_bias(scripted):
    """The params the router sends for ``tool_choice="none"``, through the engine's real logits
    processing: a `<tool_call>` logit 1000 above every other, plus the client's +100 bias, still
    never wins (a bias, even the lowest OpenAI allows, could not hold it back)."""
    backend, client, tokenizer = scripted
    start = tokenizer.token_to_id("<tool_call>")
    client.chat.completions.create(model=MODEL, messages=_user("x"), tools=TOOLS, tool_choice="none", max_tokens=4,
                                   logit_bias={str(start): 100})
    params = backend.generated[-1][2]
    assert {tokenizer.token_to_id(t) for t in TOOL_MARKUP} <= set(params.banned_token_ids)
    assert dict(params.logit_bias) == {start: 100}  # the client's bias is kept as sent
    req = Request("r", [1, 2], params)
    processor = LogitsProcessor(tokenizer, tokenizer.vocab_size)
    processor.attach(req)
    logits = torch.zeros(1, tokenizer.vocab_size)
    logits[0, start] = 1000.0
    assert int(processor.first_token_logits(req, logits).argmax()) != start


def test_stop_strings_end_the_request_where_the_text_is_made(scripted):
    backend, client, _ = scripted
    aborts = len(backend.aborted)
    out = client.chat.completions.create(model=MODEL, messages=_user("x"), stop=["STOP"], max_tokens=100)
    assert out.choices[0].message.content == "one two " and out.choices[0].finish_reason == "stop"
    assert len(backend.aborted) == aborts  # the backend stopped by itself: no abort round trip
    chunks = client.chat.completions.create(model=MODEL, messages=_user("x"), stop="STOP", stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two "


def test_tokenization_runs_off_the_event_loop(scripted):
    _, client, tokenizer = scripted
    tokenizer.threads.clear()
    client.chat.completions.create(model=MODEL, messages=_user("x"), max_tokens=1)
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert len(tokenizer.threads) == 2  # the chat template's encode, the text prompt's encode
    assert not any(name.startswith("uvicorn-") for name in tokenizer.threads), tokenizer.threads


def test_completions_stream_with_usage_and_logprobs(scripted):
    _, client, _ = scripted
    kwargs = {"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 0}
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].text == "one two STOP"[: len(whole.choices[0].text)] and whole.choices[0].text
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 3
    assert len(whole.choices[0].logprobs.token_logprobs) == 3
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3

