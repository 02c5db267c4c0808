"""Helpers for the router tests: a real uvicorn server on 127.0.0.1 in a thread, and a scripted
backend that replays fixed token ids (for paths the tiny model cannot be steered into)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.core.stop_checker import StopChecker
from glmserve.services.router.backend import GenerationBackend, RequestHints
from glmserve.text.output_text import OutputText
from glmserve.text.tokenizer import Tokenizer
from tests.shared import HAS_MODEL, MODEL_DIR, free_port  # noqa: F401 - re-exported to the tests


@contextmanager
def serve(app, ready_path: str | None = "/ready", timeout_s: float = 120.0) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free loopback port; yields the base URL once it answers
    ``ready_path`` with 200 (or once it listens, when ``ready_path`` is None)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if server.started and (ready_path is None or _ok(base + ready_path)):
                break
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"server on port {port} did not become ready")
            time.sleep(0.05)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class ScriptedBackend(GenerationBackend):
    """Answers every request with ``script(prompt_ids)``'s token ids, one per event, with their
    text made as an engine makes it (`OutputText`: a stop string ends the request), then "stop".
    Records what reached it; ``is_ready`` and ``fail_with`` steer readiness and failures."""

    def __init__(self, script: Callable[[list[int]], list[int]], tokenizer: Tokenizer,
                 delay_s: float = 0.0):
        self.script, self.tokenizer = script, tokenizer
        self.delay_s = delay_s
        self.generated: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.hints: list[RequestHints | None] = []
        self.is_ready = True
        self.fail_with: str | None = None  # an error message for the next requests' first event
        self.fail_after = 0  # ... or for the event after this many tokens

    def ready(self) -> bool:
        return self.is_ready

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        hints: RequestHints | None = None,
    ) -> AsyncIterator[TokenEvent]:
        self.generated.append((request_id, list(prompt_ids), params))
        self.hints.append(hints)
        if self.fail_with is not None and not self.fail_after:
            yield TokenEvent.ended(request_id, "error", self.fail_with)
            return
        checker = StopChecker(params)
        text = OutputText(self.tokenizer, params, checker)
        ids = self.script(prompt_ids)[: params.max_tokens]
        for i, token in enumerate(ids):
            await asyncio.sleep(self.delay_s)
            if self.fail_with is not None and i == self.fail_after:
                yield TokenEvent.ended(request_id, "error", self.fail_with)
                return
            if request_id in self.aborted:  # the contract: an aborted stream ends with "abort"
                yield TokenEvent.ended(request_id, "abort")
                return
            checker.check_tokens([token])
            if i == len(ids) - 1 and not checker.finished:
                checker.finish_reason = "stop"  # the script ended: as if by an eos token
            delta = text.push([token])
            logprobs = [-0.5] if params.logprobs is not None else []
            top = [[(token, -0.5)] * params.logprobs] if params.logprobs else []
            yield TokenEvent(request_id, [token], delta, logprobs, top, checker.finish_reason, checker.stop_reason)
            if checker.finished:
                return


def accumulated_stream(client, **kwargs):
    """A chat stream put together by the `openai` client's own helpers (`chat.completions.stream`):
    the final choice, and every chunk's delta in order."""
    deltas = []
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                deltas.append(event.chunk.choices[0].delta)
        return stream.get_final_completion().choices[0], deltas


def message_parts(choice) -> dict:
    """What a chat choice says, ids aside: content, reasoning, calls (name, arguments), finish."""
    m = choice.message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return {"content": m.content or "", "reasoning": getattr(m, "reasoning_content", None), "calls": calls,
            "finish": choice.finish_reason}


AGENT_CALL_TEXT = "Let me look.<tool_call>read_file<arg_key>path</arg_key><arg_value>a.py</arg_value></tool_call>"


def agent_script(tokenizer: Tokenizer) -> Callable[[list[int]], list[int]]:
    """A scripted agent turn: a tool result in the prompt gets "The file says hello.", a prompt
    with SCRIPT-CALL gets `AGENT_CALL_TEXT` (text, then a read_file call), any other six words."""
    call, answer = tokenizer.encode(AGENT_CALL_TEXT), tokenizer.encode("The file says hello.")
    words = tokenizer.encode("one two three four five six")

    def script(prompt: list[int]) -> list[int]:
        text = tokenizer.decode(prompt)
        if "<tool_response>" in text:
            return answer
        return call if "SCRIPT-CALL" in text else words

    return script
