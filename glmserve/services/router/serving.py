"""OpenAIServing: the router's transport-free serving layer. HTTP routes (`app`) are thin adapters
over it: they read the body and the client's presence, it answers with an `Answer`.

Per request, in this order: model (404), draining and backend readiness (503), a length bound
without tokenizing (400: the text's characters over the longest token's bytes), the prompt (chat
template and tokenization off the event loop; 400 on a bad chat or prompt), context length (400),
then the run
(`RequestRun`): its admission (429 / 503 with ``Retry-After``) and its first event come before the
`Answer` exists, so a refusal is an HTTP status, never an error inside a started stream. The backend's events carry the text (stop strings already applied where the engine
runs); here it is only formatted, and read for reasoning and tool calls (`chat_output`). Fields were checked when the body was
parsed (`openai_requests`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from glmserve.core.generation import SamplingParams
from glmserve.services.router import completion_bodies as bodies
from glmserve.services.router.admission import AdmissionConfig, AdmissionQueue
from glmserve.services.router.admission_metrics import AdmissionMetrics
from glmserve.services.router.backend import GenerationBackend
from glmserve.services.router.chat_output import ChatOutput, grammar_reasoning
from glmserve.services.router.errors import (
    APIError,
    from_value_error,
    invalid_request,
    model_not_found,
    refused,
    service_unavailable,
)
from glmserve.services.router.metrics import RouterMetrics
from glmserve.services.router.openai_requests import ChatCompletionRequest, CompletionRequest, GenerationBody
from glmserve.services.router.request_run import Output, RequestContext, RequestRun
from glmserve.services.router.tokenize_requests import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize_answer,
    tokenize_answer,
)
from glmserve.services.router.tool_call_parsing import CallParsing
from glmserve.text.reasoning_parser import reasoning_start
from glmserve.text.special_tokens import THINK_TAGS, TOOL_MARKUP
from glmserve.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """A whole JSON ``body`` (``status`` 499: the client left first, nobody reads it), or a stream
    of ``chunks`` (each one JSON object; an error object may end it); ``run``: the request's run,
    when one was accepted (a stream's transport closes it); ``named_events``: each chunk is an SSE
    event named by its ``type`` and no ``[DONE]`` follows (the Responses and Messages APIs)."""

    body: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None
    run: RequestRun | None = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    named_events: bool = False


class OpenAIServing:
    """Chat and legacy completions over ``backend`` for the one served model."""

    def __init__(self, backend: GenerationBackend, tokenizer: Tokenizer, model_name: str, max_context: int,
                 metrics: RouterMetrics, admission: AdmissionConfig | None = None,
                 separate_reasoning: bool = True) -> None:
        if max_context < 2:
            raise ValueError(f"max_context: must be >= 2, got {max_context}")
        self.backend, self.tokenizer, self.model_name = backend, tokenizer, model_name
        self.max_context, self.metrics = max_context, metrics
        self.admission = AdmissionQueue(admission or AdmissionConfig(),
                                        AdmissionMetrics(metrics.registry, metrics.rejected))
        self.separate_reasoning = separate_reasoning  # a request's default (`--reasoning-parser`)
        self.started = int(time.time())  # the model card's `created`
        self._runs: set[RequestRun] = set()  # opened or opening, until closed

    def models(self) -> dict[str, Any]:
        return bodies.model_list(self.model_name, self.started, self.max_context)

    def model(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{id}``: the card, or 404 for any other id."""
        if model_id != self.model_name:
            raise model_not_found(model_id)
        return bodies.model_card(self.model_name, self.started, self.max_context)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        if body.model != self.model_name:
            raise model_not_found(body.model)
        try:
            if body.prompt is not None:
                ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt)
            else:
                ids = await asyncio.to_thread(self.tokenizer.apply_chat_template, body.template_messages(),
                                              body.template_tools(), True, body.chat_template_kwargs)
        except ValueError as e:
            raise from_value_error(e, "messages") from e
        return tokenize_answer(ids, self.max_context)

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        if body.model != self.model_name:
            raise model_not_found(body.model)
        vocab = self.tokenizer.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise invalid_request(f"tokens: token ids must be in 0..{vocab - 1}", "tokens")
        return detokenize_answer(await asyncio.to_thread(self.tokenizer.decode, body.tokens))

    async def chat(self, body: ChatCompletionRequest, ctx: RequestContext) -> Answer:
        self._admit(body)
        body.check_length_bound(body.text_chars() // self.tokenizer.max_token_bytes, self.max_context, "messages")
        tools = body.active_tools()
        prompt = await self.chat_prompt(body.template_messages(), tools, body.chat_template_kwargs)
        params, output = self.chat_params(body, prompt, tools)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        run = self.run(rid, prompt, params, ctx)
        if not await run.open():
            return Answer(status=499)
        if body.stream:
            return Answer(chunks=self._chat_chunks(run, created, output, body.include_usage), run=run)
        out = await _whole(run)
        if isinstance(out, Answer):
            return out
        parsed = output.parse(out.text)
        logprobs = bodies.chat_logprobs(out.logprobs) if params.logprobs is not None else None
        content = parsed.content if parsed.content or not parsed.tool_calls else None
        return Answer(bodies.chat_completion(
            rid, created, self.model_name, content, parsed.tool_calls,
            _finish_reason(out.finish_reason, bool(parsed.tool_calls)), self._usage(run), logprobs,
            parsed.reasoning or None,
        ), run=run)

    async def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template_kwargs: dict[str, Any] | None) -> list[int]:
        """The chat template's prompt ids (off the event loop); 400 on a bad chat."""
        try:
            return await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, tools, True,
                                           template_kwargs)
        except ValueError as e:
            raise from_value_error(e, "messages") from e

    def chat_params(self, body: ChatCompletionRequest, prompt: list[int],
                    tools: list[dict[str, Any]] | None) -> tuple[SamplingParams, ChatOutput]:
        """The sampling of a chat request and how its output is read: the grammar starts after
        the reasoning, the markup the parsers read stays in the text, and with tools offered
        but ``tool_choice`` "none" the markup is banned (no bias can bring a call back)."""
        separate = self.separate_reasoning if body.separate_reasoning is None else body.separate_reasoning
        start = reasoning_start(prompt, self.tokenizer)
        grammar = body.grammar()
        if grammar is not None:
            grammar = grammar.with_reasoning(grammar_reasoning(start, separate))
        params = body.sampling_params(len(prompt), self.max_context, "messages", self.tokenizer.vocab_size, grammar)
        params = replace(params, visible_special_tokens=THINK_TAGS + (TOOL_MARKUP if tools is not None else ()))
        if tools is None and body.tools:
            params = replace(params, banned_token_ids=self._tool_markup_ids)
        calls = CallParsing(tools, strip_values=grammar is not None and grammar.kind == "tool_calls",
                            parallel=body.parallel_tool_calls)
        return params, ChatOutput(calls, start, separate)

    async def completion(self, body: CompletionRequest, ctx: RequestContext) -> Answer:
        self._admit(body)
        body.check_length_bound(body.text_chars() // self.tokenizer.max_token_bytes, self.max_context, "prompt")
        body.check_token_ids(self.tokenizer.vocab_size)
        prompt = body.prompt
        ids = await asyncio.to_thread(self.tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise from_value_error(ValueError("prompt: the prompt has no tokens"))
        params = body.sampling_params(len(ids), self.max_context, "prompt", self.tokenizer.vocab_size, body.grammar())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        run = self.run(rid, ids, params, ctx)
        if not await run.open():
            return Answer(status=499)
        if body.stream:
            return Answer(chunks=self._completion_chunks(run, created, body.include_usage), run=run)
        out = await _whole(run)
        if isinstance(out, Answer):
            return out
        logprobs = bodies.completion_logprobs(out.logprobs, 0) if params.logprobs is not None else None
        return Answer(bodies.completion(rid, created, self.model_name, out.text, out.finish_reason,
                                        logprobs, self._usage(run)), run=run)

    def run(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            ctx: RequestContext) -> RequestRun:
        """One request through the admission queue and the backend (for every API built on this
        layer); `RequestRun.open` it before answering."""
        run = RequestRun(self.backend, self.metrics, self.tokenizer, request_id, prompt_ids, params, ctx,
                         self.admission, self._runs.discard)
        self._runs.add(run)
        return run

    @property
    def draining(self) -> bool:
        return self.admission.draining

    async def drain(self, timeout_s: float, end_wait_s: float = 5.0) -> int:
        """Stop admitting (new and queued requests get 503 + ``Retry-After``), let the running ones
        finish for up to ``timeout_s``, then end the rest: each answer ends with an OpenAI error (an
        SSE error event then ``[DONE]``, or a JSON 503), never a cut stream. Returns how many had to
        be ended."""
        self.admission.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._runs and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._runs)
        if left:
            log.warning("drain timeout (%.0f s): ending %d running requests with an error", timeout_s, len(left))
        await asyncio.gather(*(run.end() for run in left))
        deadline = loop.time() + end_wait_s
        while self._runs and loop.time() < deadline:  # their error answers go out
            await asyncio.sleep(0.02)
        return len(left)

    # --- parts ------------------------------------------------------------------------------------

    def _admit(self, body: GenerationBody) -> None:
        body.check_model(self.model_name)
        if self.admission.draining:  # before any tokenizing
            self.metrics.rejected("draining")
            log.warning("request refused (draining): 503 the server is shutting down")
            raise refused(503, "the server is shutting down", "draining", self.admission.config.retry_after_s)
        if not self.backend.ready():
            self.metrics.rejected("no_worker")
            log.warning("request refused (no_worker): 503 no healthy worker of a role")
            raise service_unavailable()

    def _usage(self, run: RequestRun) -> dict[str, Any]:
        out = run.output
        return bodies.usage(len(run.prompt_ids), out.num_generated, out.num_cached_tokens)

    @property
    def _tool_markup_ids(self) -> tuple[int, ...]:
        return tuple(i for i in (self.tokenizer.token_to_id(t) for t in TOOL_MARKUP) if i is not None)

    async def _chat_chunks(self, run: RequestRun, created: int, output: ChatOutput,
                           include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        rid, model = run.request_id, self.model_name
        stream = output.stream()
        has_calls, finish = False, None
        yield bodies.chat_chunk(rid, created, model, {"role": "assistant", "content": ""})
        try:
            async with aclosing(run.deltas()) as deltas:
                async for text, logprobs, finish in deltas:
                    part = stream.feed(text)
                    if finish is not None:
                        part.add(stream.finish())
                    has_calls = has_calls or bool(part.tool_calls)
                    if part.reasoning or part.content or part.tool_calls or logprobs:
                        lp = bodies.chat_logprobs(logprobs) if run.params.logprobs is not None else None
                        yield bodies.chat_chunk(rid, created, model, bodies.chat_delta(part), None, lp)
        except APIError as e:
            yield e.to_dict()
            return
        if finish is None:
            return  # the client went away
        yield bodies.chat_chunk(rid, created, model, {}, _finish_reason(finish, has_calls))
        if include_usage:
            yield bodies.usage_chunk(rid, created, model, "chat.completion.chunk", self._usage(run))

    async def _completion_chunks(self, run: RequestRun, created: int,
                                 include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        rid, model = run.request_id, self.model_name
        finish, offset = None, 0
        try:
            async with aclosing(run.deltas()) as deltas:
                async for text, logprobs, finish in deltas:
                    if text or logprobs or finish:
                        lp = bodies.completion_logprobs(logprobs, offset) if run.params.logprobs is not None else None
                        yield bodies.completion(rid, created, model, text, finish, lp)
                    offset += len(text)
        except APIError as e:
            yield e.to_dict()
            return
        if finish is not None and include_usage:
            yield bodies.usage_chunk(rid, created, model, "text_completion", self._usage(run))


async def _whole(run: RequestRun) -> Output | Answer:
    """The run's whole output, or the answer it ends with instead (an error, or 499)."""
    try:
        out = await run.run_to_end()
    except APIError as e:  # counted by the run already
        return Answer(e.to_dict(), status=e.status, headers=e.headers)
    return out if out.finish_reason is not None else Answer(status=499)


def _finish_reason(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason == "stop" else reason
