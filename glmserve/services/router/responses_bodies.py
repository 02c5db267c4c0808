"""``POST /v1/responses`` request bodies (the OpenAI Responses API) as pydantic models, and the chat
messages and chat request they become (`agent_chat`).

Input: a string (one user message) or a list of items: messages (``role`` user / assistant / system
/ developer; content a string or ``input_text`` / ``output_text`` parts), ``function_call`` and
``function_call_output`` items, and ``reasoning`` items (their text becomes the next assistant
message's ``reasoning_content``: the chat template shows it while a tool loop runs, so the prompt
still starts with what the model wrote). ``reasoning.effort`` "none" closes the think block up
front, any other effort opens it (``enable_thinking``); unset, the model decides. Function tools only, in the Responses' flat shape (``name`` at the top). Types are
strict and unknown fields ignored, as on the chat path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Strict, Tag, model_validator

from glmserve.services.router.agent_chat import function_tool, sampling, tool_call
from glmserve.services.router.body_types import Bool, OpenBody, Str, by_type
from glmserve.services.router.openai_requests import Float32

NonEmpty = Annotated[str, Strict(), Field(min_length=1)]
# Error messages name the Responses' fields, not the chat request's.
PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
               "tool_choice": "tool_choice", "tools": "tools"}


class InputTextPart(OpenBody):
    type: Literal["input_text", "output_text", "text"]
    text: Str


def _text(content: str | list[InputTextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(OpenBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Str | list[InputTextPart]


class FunctionCallItem(OpenBody):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: Str
    id: Str | None = None


class FunctionCallOutputItem(OpenBody):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: Str | list[InputTextPart]


class ReasoningPart(OpenBody):
    type: Literal["reasoning_text", "summary_text"]
    text: Str


class ReasoningItem(OpenBody):
    type: Literal["reasoning"]
    content: list[ReasoningPart] | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)

    def text(self) -> str:
        return "".join(part.text for part in self.content or self.summary)


class ReasoningConfig(OpenBody):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def enable_thinking(self) -> bool | None:
        return None if self.effort is None else self.effort != "none"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    by_type("message"),  # a message may leave its type out
]


class FunctionTool(OpenBody):
    type: Literal["function"]
    name: NonEmpty
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class FunctionToolChoice(OpenBody):
    type: Literal["function"]
    name: Str


class TextFormat(OpenBody):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` (flat: name, schema, strict)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Str | None = None
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None

    def response_format(self) -> dict[str, Any]:
        """The chat ``response_format`` for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = sampling(name=self.name or "response", description=self.description, schema=self.schema_,
                          strict=self.strict)
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(OpenBody):
    format: TextFormat | None = None


class ResponsesRequest(OpenBody):
    """``POST /v1/responses``."""

    model: NonEmpty
    input: Str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: Bool = True
    max_output_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    temperature: Annotated[Float32, Field(ge=0)] | None = None
    top_p: Annotated[Float32, Field(gt=0, le=1)] | None = None
    text: TextConfig | None = None
    stream: Bool = False
    store: Bool = True
    previous_response_id: NonEmpty | None = None
    user: Str | None = None
    prompt_cache_key: Str | None = None  # what Codex sets per conversation: the session
    metadata: dict[str, Str] | None = None
    reasoning: ReasoningConfig | None = None

    @model_validator(mode="after")
    def _non_empty(self) -> ResponsesRequest:
        if self.input == "":
            raise ValueError("input: must not be empty")
        return self

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (function calls join the assistant message before them)."""
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out: list[dict[str, Any]] = []
        reasoning = ""  # for the assistant message that follows
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning += item.text()
                continue
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = tool_call(item.call_id, item.name, item.arguments)
                if out and out[-1]["role"] == "assistant" and not reasoning:
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "content": _text(item.output), "tool_call_id": item.call_id})
            if reasoning and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        if not out:
            raise ValueError("input: no message or function call items")
        return out

    def chat_body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request for ``messages`` (the conversation so far, this input included)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        choice: Any = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        tools = [function_tool(t.name, t.description, t.parameters) for t in self.tools or []]
        if not tools and choice in ("auto", "none"):  # OpenAI accepts these without tools
            choice = None
        fmt = self.text.format if self.text is not None else None
        return {"model": self.model, "messages": system + messages, "stream": self.stream,
                "parallel_tool_calls": self.parallel_tool_calls,
                **({"stream_options": {"include_usage": True}} if self.stream else {}),
                **sampling(tools=tools or None, tool_choice=choice, max_tokens=self.max_output_tokens,
                           temperature=self.temperature, top_p=self.top_p,
                           response_format=fmt.response_format() if fmt is not None else None,
                           user=self.session_user, chat_template_kwargs=self._template_kwargs())}

    def _template_kwargs(self) -> dict[str, Any] | None:
        thinking = self.reasoning.enable_thinking() if self.reasoning is not None else None
        return {"enable_thinking": thinking} if thinking is not None else None

    @property
    def session_user(self) -> str | None:
        """The session the request belongs to, for session affinity."""
        return self.user or self.prompt_cache_key

    def echo(self) -> dict[str, Any]:
        """The request fields a Response object repeats."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionToolChoice) else self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "temperature": self.temperature if self.temperature is not None else 1.0,
            "top_p": self.top_p if self.top_p is not None else 1.0,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
            "store": self.store,
            "metadata": self.metadata or {},
            "user": self.user,
            "truncation": "disabled",
        }
