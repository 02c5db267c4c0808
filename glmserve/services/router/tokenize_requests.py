"""Bodies of ``POST /tokenize`` and ``POST /detokenize`` (as vLLM and SGLang offer them), and their
answers. ``/tokenize`` takes a ``prompt`` (tokenized as ``/v1/completions`` does) or chat
``messages`` (+ ``tools``, ``chat_template_kwargs``; rendered as ``/v1/chat/completions`` does, generation prompt included),
so a client can count exactly what a request will cost."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, Strict, model_validator

from glmserve.services.router.body_types import Int, OpenBody, Str
from glmserve.services.router.openai_requests import ChatMessage, Tool


class TokenizeRequest(OpenBody):
    model: Annotated[str, Strict(), Field(min_length=1)]
    prompt: Str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt and messages")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages or []]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class DetokenizeRequest(OpenBody):
    model: Annotated[str, Strict(), Field(min_length=1)]
    tokens: list[Int]


def tokenize_answer(ids: list[int], max_context: int) -> dict[str, Any]:
    return {"tokens": ids, "count": len(ids), "max_model_len": max_context}


def detokenize_answer(text: str) -> dict[str, Any]:
    return {"prompt": text}
