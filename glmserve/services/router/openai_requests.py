"""OpenAI request bodies as pydantic models: FastAPI serves their JSON schema in ``/openapi.json``,
and `parse_body` validates a raw body into one (transport-free; responses are built in
`completion_bodies`).

Every rejection is an `APIError` 400 naming the field (``param``), raised before anything reaches
a backend. Types are strict (``"1.5"`` is not a number, ``1`` is not a boolean, numbers are finite).
Numbers are checked against what the wire carries before any cast: floats must keep their value's
kind as float32 (``temperature: 1e308`` would become inf, ``top_p: 1e-46`` zero), integers must fit
their proto field. The JSON parser itself refuses invalid UTF-8, lone surrogates and nesting past
its recursion limit (400, not a RecursionError).
Unknown fields are ignored, as OpenAI-compatible servers do. Ranges of the sampling parameters are
`SamplingParams`'s; the schema states the same bounds.
"""

from __future__ import annotations

import math
import struct
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, Field, Strict, ValidationError, model_validator

from glmserve.core.generation import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, SamplingParams
from glmserve.core.grammar_spec import GrammarSpec
from glmserve.services.router.body_types import Bool, Int, OpenBody, Str
from glmserve.services.router.errors import (
    APIError,
    context_length_exceeded,
    from_value_error,
    invalid_request,
    model_not_found,
)
from glmserve.services.router.response_format import ResponseFormat

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API allows 0..5
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

Penalty = Annotated[float, Strict(), Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
Body = TypeVar("Body", bound="GenerationBody")
MAX_STOP_STRINGS = 16


def _as_float32(value: float) -> float:
    """``value`` when float32 keeps it: finite, and not flushed to zero (the proto's ``float``)."""
    try:
        narrowed = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        narrowed = math.inf
    if math.isinf(narrowed):
        raise ValueError(f"must be at most {3.4e38:g} in magnitude (a float32)")
    if value != 0 and narrowed == 0:
        raise ValueError(f"must be 0 or at least {1.2e-38:g} in magnitude (a float32)")
    return value


Float32 = Annotated[float, Strict(), Field(allow_inf_nan=False), AfterValidator(_as_float32)]


class StreamOptions(OpenBody):
    include_usage: Bool = False


class TextPart(OpenBody):
    type: Literal["text"]
    text: Str


class FunctionCall(OpenBody):
    name: Str
    arguments: Str = "{}"


class ToolCall(OpenBody):
    id: Str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: Str | None = None  # an earlier answer's reasoning (the template decides its use)

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        for name in ("tool_calls", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"{name}: only on assistant messages")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: required for role {self.role!r}")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: role normalised, content one string."""
        out = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**out, "role": ROLES[self.role], "content": content}


class FunctionSpec(OpenBody):
    name: Annotated[str, Strict(), Field(min_length=1)]
    description: Str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class Tool(OpenBody):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(OpenBody):
    name: Str


class NamedToolChoice(OpenBody):
    type: Literal["function"] = "function"
    function: NamedFunction


class GenerationBody(OpenBody):
    """What chat and completions bodies share."""

    model: Annotated[str, Strict(), Field(min_length=1)]
    stream: Bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    temperature: Annotated[Float32, Field(ge=0)] = 1.0
    top_p: Annotated[Float32, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Strict(), Field(ge=-1, le=2**31 - 1)] = -1  # vLLM extension; -1 or 0: off
    seed: Annotated[int, Strict(), Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Str | list[Str] | None = None
    ignore_eos: Bool = False  # vLLM extension
    n: Int = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[Float32, Field(gt=0)] = 1.0  # vLLM extension
    min_p: Annotated[Float32, Field(ge=0, le=1)] = 0.0  # vLLM extension
    logit_bias: dict[str, Annotated[float, Strict(), Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None
    response_format: ResponseFormat | None = None
    user: Str | None = None
    priority: Annotated[int, Strict(), Field(ge=-(2**31), le=2**31 - 1)] = 0  # vLLM extension: lower first

    @model_validator(mode="after")
    def _supported(self) -> GenerationBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.n != 1:
            raise ValueError("n: only n = 1 is supported")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings")
        if any(not key.isdigit() for key in self.logit_bias or {}):
            raise ValueError("logit_bias: keys must be token ids (decimal strings)")
        return self

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """``logit_bias`` by token id; 400 for an id outside the vocabulary."""
        bias = {int(key): value for key, value in (self.logit_bias or {}).items()}
        bad = [t for t in bias if t >= vocab_size]
        if bad:
            raise invalid_request(f"logit_bias: token ids must be in 0..{vocab_size - 1}, got {bad[:5]}", "logit_bias")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def logprobs_count(self) -> int | None:
        """`SamplingParams.logprobs`: None, or how many alternatives per token."""
        raise NotImplementedError

    def sampling_params(self, num_prompt: int, max_context: int, param: str, vocab_size: int,
                        grammar: GrammarSpec | None = None) -> SamplingParams:
        """The request's sampling; without a max the completion may fill the rest of the context.
        400 (``context_length_exceeded`` on ``param``) when prompt and completion do not fit."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = limit if limit is not None else max_context - num_prompt
        if max_tokens < 1 or num_prompt + max_tokens > max_context:
            raise context_length_exceeded(num_prompt, max(max_tokens, 1), max_context, param)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                                  logprobs=self.logprobs_count, min_p=self.min_p,
                                  repetition_penalty=self.repetition_penalty,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  logit_bias=self.token_bias(vocab_size), grammar=grammar)
        except ValueError as e:
            raise from_value_error(e) from e

    def check_length_bound(self, least_tokens: int, max_context: int, param: str) -> None:
        """400 (``context_length_exceeded``) when a prompt of at least ``least_tokens`` tokens
        cannot fit: checked before tokenizing, so a huge prompt costs no tokenizer time."""
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if least_tokens + (limit or 1) > max_context:
            raise invalid_request(
                f"This model's maximum context length is {max_context} tokens. However, the prompt alone "
                f"has at least {least_tokens} tokens. Please reduce the length of the prompt.",
                param, "context_length_exceeded")

    def grammar(self) -> GrammarSpec | None:
        """What the output must match (``response_format``; None: free)."""
        return self._format_grammar()

    def _format_grammar(self) -> GrammarSpec | None:
        try:
            return self.response_format.grammar() if self.response_format is not None else None
        except ValueError as e:
            raise from_value_error(e) from e

    def check_model(self, served: str) -> None:
        """404 unless the request names the served model."""
        if self.model != served:
            raise model_not_found(self.model)


class ChatCompletionRequest(GenerationBody):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    logprobs: Bool = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM / SGLang extension, e.g. enable_thinking
    separate_reasoning: Bool | None = None  # SGLang extension; None: the router's --reasoning-parser

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs = true")
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: names a function that is not in tools: "
                             f"{self.tool_choice.function.name!r}")
        if self.tool_choice in ("auto", "required") and not self.tools:
            raise ValueError("tool_choice: only allowed when tools are given")
        if self.forces_tool_calls and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format: cannot be combined with a required or named tool_choice")
        return self

    def grammar(self) -> GrammarSpec | None:
        """What the output must match: the tool calls ``tool_choice`` forces, or ``response_format``."""
        tools = self.active_tools()
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        try:
            forced = GrammarSpec.from_tool_choice(tools, choice, self.parallel_tool_calls) if tools else None
        except ValueError as e:
            raise from_value_error(e) from e
        return forced if forced is not None else self._format_grammar()

    @property
    def forces_tool_calls(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def text_chars(self) -> int:
        """Characters of the messages' text (a lower bound of what the template renders)."""
        return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content or ())
                   for m in self.messages)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools to render and parse calls for (None: absent, or ``tool_choice`` "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class CompletionRequest(GenerationBody):
    """``POST /v1/completions`` (one prompt: a string or token ids; a batch of one is accepted)."""

    prompt: Str | list[Int] | list[Str | list[Int]]
    logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    best_of: Int = 1
    echo: Bool = False
    suffix: Str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = self.prompt = prompt[0]  # a batch of one
        if not prompt or (isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)):
            raise ValueError("prompt: expected a non-empty string or array of token ids (one prompt)")
        if self.best_of != 1:
            raise ValueError("best_of: only 1 is supported")
        if self.echo or self.suffix:
            raise ValueError("echo: echo and suffix are not supported")
        return self

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    def text_chars(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, str) else 0

    def check_token_ids(self, vocab_size: int) -> None:
        if isinstance(self.prompt, list) and not all(0 <= t < vocab_size for t in self.prompt):
            raise invalid_request(f"prompt: token ids must be in 0..{vocab_size - 1}", "prompt")


def parse_body(model: type[Body], raw: bytes) -> Body:
    """Validate a raw JSON body into ``model``; the first problem becomes a 400 naming its field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise _bad_request(e) from None


def _bad_request(error: ValidationError) -> APIError:
    errors = error.errors(include_url=False)
    # Of the first field's errors, the deepest: for a union (`content`: a string or parts) the
    # part that is wrong, not "should be a string".
    first = max((e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]), key=lambda e: len(e["loc"]))
    loc = [str(part) for part in first["loc"] if not _is_branch(part)]
    if first["type"] == "json_invalid":
        return invalid_request(f"The request body is not valid JSON: {first['msg']}")
    if first["type"] == "model_type" and not loc:
        return invalid_request("The request body must be a JSON object.")
    message = str(first["msg"]).removeprefix("Value error, ")
    if loc:  # a field's own check: the top-level field is the param
        return invalid_request(f"{'.'.join(loc)}: {message}", loc[0])
    return from_value_error(ValueError(message))  # a cross-field check: "<field>: ..."



def _is_branch(part: Any) -> bool:
    """A union member's label in an error location (``str``, ``list[...]``), not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list"))
