"""The chat request an agent API's body becomes (`/v1/responses`, `/v1/messages`).

The agent APIs are thin adapters: their bodies are rewritten into an OpenAI chat request (messages
in the chat template's shape, function tools, tool_choice, sampling) and answered by the chat path
(`OpenAIServing.chat`), so prompts, prefix caching, sessions, admission and tool-call enforcement
are the chat path's own. Field names in errors are the agent API's (``param_names``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ValidationError

from glmserve.services.router.errors import APIError, from_value_error, invalid_request
from glmserve.services.router.openai_requests import ChatCompletionRequest


def chat_request(data: dict[str, Any], param_names: dict[str, str]) -> ChatCompletionRequest:
    """``data`` (a chat body) validated; a problem is a 400 naming the agent API's field."""
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = [str(part) for part in first["loc"]]
        message = str(first["msg"]).removeprefix("Value error, ")
        if not loc:  # a cross-field check: "<field>: ..."
            raise renamed(from_value_error(ValueError(message)), param_names) from None
        field = param_names.get(loc[0], loc[0])
        raise invalid_request(f"{field}: {message}", field) from None


def renamed(err: APIError, param_names: dict[str, str]) -> APIError:
    """``err`` with a chat field name (``messages``, ``max_tokens``) replaced by the agent API's."""
    if err.param not in param_names:
        return err
    new = param_names[err.param]
    message = err.message.replace(f"{err.param}:", f"{new}:", 1)
    return dataclasses.replace(err, param=new, message=message)


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A chat function tool."""
    fn: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description is not None:
        fn["description"] = description
    return {"type": "function", "function": fn}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A chat assistant message's tool call (``arguments``: a JSON object's text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def sampling(**fields: Any) -> dict[str, Any]:
    """The chat sampling fields that are set (None: the chat default)."""
    return {key: value for key, value in fields.items() if value is not None}
