"""``POST /v1/messages`` request bodies (Anthropic's Messages API) as pydantic models, and the chat
request they become (`agent_chat`).

``system``: a string or text blocks; ``messages``: user / assistant turns whose content is a string
or blocks: ``text``, ``tool_use`` (assistant), ``tool_result`` (user; its content a string or text
blocks); ``thinking`` blocks become the chat message's ``reasoning_content`` (the template shows it
while a tool loop runs). ``thinking.type`` enabled / disabled opens / closes the think block up
front (``enable_thinking``); adaptive and unset leave it to the model. Client tools (``input_schema``) only;
``tool_choice`` auto / any / tool / none maps to the chat path's auto / required / named / none.
Types are strict and unknown fields ignored (``cache_control`` included: prefix caching is
automatic here).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, Tag, model_validator

from glmserve.services.router.agent_chat import function_tool, sampling, tool_call
from glmserve.services.router.body_types import Bool, OpenBody, Str, by_type
from glmserve.services.router.openai_requests import MAX_STOP_STRINGS, Float32

NonEmpty = Annotated[str, Strict(), Field(min_length=1)]
# Error messages name the Messages API's fields.
PARAM_NAMES = {"stop": "stop_sequences", "response_format": "output_config"}


class TextBlockParam(OpenBody):
    type: Literal["text"]
    text: Str


class ToolUseBlockParam(OpenBody):
    type: Literal["tool_use"]
    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any]


class ToolResultBlockParam(OpenBody):
    type: Literal["tool_result"]
    tool_use_id: NonEmpty
    content: Str | list[TextBlockParam] = ""
    is_error: Bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlockParam(OpenBody):
    type: Literal["thinking", "redacted_thinking"]
    thinking: Str = ""  # a redacted block's data is opaque: nothing to show the model


Block = Annotated[
    Annotated[TextBlockParam, Tag("text")]
    | Annotated[ToolUseBlockParam, Tag("tool_use")]
    | Annotated[ToolResultBlockParam, Tag("tool_result")]
    | Annotated[ThinkingBlockParam, Tag("thinking")]
    | Annotated[ThinkingBlockParam, Tag("redacted_thinking")],
    by_type(),
]


class MessageParam(OpenBody):
    role: Literal["user", "assistant"]
    content: Str | list[Block]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> MessageParam:
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        if self.role == "user" and "tool_use" in kinds:
            raise ValueError("tool_use blocks belong to assistant messages")
        if self.role == "assistant" and "tool_result" in kinds:
            raise ValueError("tool_result blocks belong to user messages")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """This turn as chat messages: a tool message per ``tool_result``, text as one message."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        out: list[dict[str, Any]] = []
        text, calls, thinking = "", [], ""
        for block in self.content:
            if isinstance(block, ThinkingBlockParam):
                thinking += block.thinking
            elif isinstance(block, TextBlockParam):
                text += block.text
            elif isinstance(block, ToolUseBlockParam):
                calls.append(tool_call(block.id, block.name, json.dumps(block.input, ensure_ascii=False)))
            elif isinstance(block, ToolResultBlockParam):
                if text:  # text before a result keeps its place
                    out.append({"role": "user", "content": text})
                    text = ""
                out.append({"role": "tool", "content": block.text(), "tool_call_id": block.tool_use_id})
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or not out:
            out.append({"role": self.role, "content": text})
        if thinking and self.role == "assistant":
            out[-1]["reasoning_content"] = thinking
        return out


class ToolParam(OpenBody):
    type: Literal["custom"] | None = None
    name: NonEmpty
    description: Str | None = None
    input_schema: dict[str, Any]


class ToolChoiceParam(OpenBody):
    type: Literal["auto", "any", "tool", "none"]
    name: Str | None = None
    disable_parallel_tool_use: Bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceParam:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name: required when type is tool, and only then")
        return self

    def chat(self) -> Any:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class MetadataParam(OpenBody):
    user_id: Str | None = None


class ThinkingConfigParam(OpenBody):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]

    def enable_thinking(self) -> bool | None:
        return {"enabled": True, "disabled": False}.get(self.type)


class JSONOutputFormatParam(OpenBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(OpenBody):
    """``output_config``: ``format`` (structured outputs) is enforced; ``effort`` is ignored."""

    format: JSONOutputFormatParam | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat ``response_format`` (strict: the output is valid for the schema)."""
        if self.format is None:
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": self.format.schema_,
                                                       "strict": True}}


class CountTokensRequest(OpenBody):
    """``POST /v1/messages/count_tokens``: the prompt part of a messages request."""

    model: NonEmpty
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: Str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    metadata: MetadataParam | None = None
    thinking: ThinkingConfigParam | None = None

    @model_validator(mode="after")
    def _choice_fits_tools(self) -> CountTokensRequest:
        names = [t.name for t in self.tools or []]
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice: names a tool that is not in tools: {choice.name!r}")
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError("tool_choice: needs tools")
        return self

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "".join(block.text for block in self.system) or None
        return self.system or None

    def chat_body(self) -> dict[str, Any]:
        """The chat request's prompt fields: messages, tools, tool_choice, the session."""
        system = self.system_text()
        messages = ([{"role": "system", "content": system}] if system else []) + [
            m for message in self.messages for m in message.chat_messages()]
        tools = [function_tool(t.name, t.description, t.input_schema) for t in self.tools or []]
        choice = self.tool_choice
        return {"model": self.model, "messages": messages,
                **({"parallel_tool_calls": False} if choice is not None and choice.disable_parallel_tool_use else {}),
                **sampling(tools=tools or None, tool_choice=choice.chat() if tools and choice else None,
                           user=self.session_user, chat_template_kwargs=self._template_kwargs())}

    def _template_kwargs(self) -> dict[str, Any] | None:
        thinking = self.thinking.enable_thinking() if self.thinking is not None else None
        return {"enable_thinking": thinking} if thinking is not None else None

    @property
    def session_user(self) -> str | None:
        """The session the request belongs to (``metadata.user_id``), for session affinity."""
        return self.metadata.user_id if self.metadata is not None else None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Strict(), Field(ge=1)]
    stop_sequences: Annotated[list[Str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[Float32, Field(ge=0, le=1)] | None = None
    top_p: Annotated[Float32, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Strict(), Field(ge=0, le=2**31 - 1)] | None = None
    stream: Bool = False
    output_config: OutputConfigParam | None = None

    def chat_body(self) -> dict[str, Any]:
        top_k = self.top_k if self.top_k else None  # 0: off, as -1 on the chat path
        fmt = self.output_config.response_format() if self.output_config is not None else None
        return {**super().chat_body(), "max_tokens": self.max_tokens, "stream": self.stream,
                **({"stream_options": {"include_usage": True}} if self.stream else {}),
                **sampling(stop=self.stop_sequences, temperature=self.temperature, top_p=self.top_p, top_k=top_k,
                           response_format=fmt)}
