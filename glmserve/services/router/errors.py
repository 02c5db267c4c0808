"""OpenAI-format API errors: `{"error": {"message", "type", "param", "code"}}` plus an HTTP status.

Everything the router rejects is an `APIError`; the app turns it into a JSON response (or, once a
stream has started, into an SSE error event). Transport-free: no FastAPI imports here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Seconds a client should wait before retrying when the backend cannot take the request.
DEFAULT_RETRY_AFTER_S = 1


@dataclass
class APIError(Exception):
    """An error answer: `status` is the HTTP status, the rest is the OpenAI error object."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request body is malformed or a value is out of range."""
    return APIError(400, message, "invalid_request_error", param, code)


def from_value_error(err: ValueError, default_param: str | None = None) -> APIError:
    """400 from a `ValueError("<field>: ...")` (SamplingParams, chat rendering): the field is the param."""
    message = str(err)
    head, sep, _ = message.partition(":")
    param = (
        head.strip() if sep and head.strip().replace("_", "").replace(".", "").isalnum() else default_param
    )
    return invalid_request(message, param)


# Fields a backend may refuse a request for after the router accepted it (the engine compiles the
# grammar; xgrammar alone knows which schemas it can enforce).
BACKEND_CHECKED_FIELDS = ("response_format", "tools", "logit_bias")


def refused_request(error: str | None) -> APIError | None:
    """The 400 for a generation error that names a request field the backend checks (directly,
    or after a worker's ``INVALID_ARGUMENT: ``); None for any other error."""
    message = (error or "").rpartition("INVALID_ARGUMENT: ")[2]
    if message.split(":", 1)[0].split(".")[0] not in BACKEND_CHECKED_FIELDS:
        return None
    return from_value_error(ValueError(message))


def context_length_exceeded(num_prompt: int, max_tokens: int, max_context: int, param: str) -> APIError:
    return invalid_request(
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion). "
        "Please reduce the length of the prompt or the completion.",
        param,
        "context_length_exceeded",
    )


def unauthorized() -> APIError:
    """401: API keys are configured and the request carries no valid `Authorization: Bearer` key."""
    return APIError(
        401,
        "Incorrect or missing API key. Send 'Authorization: Bearer <key>'.",
        "invalid_request_error",
        None,
        "invalid_api_key",
        {"WWW-Authenticate": "Bearer"},
    )


def model_not_found(model: str) -> APIError:
    """404: the request names a model this router does not serve."""
    return APIError(
        404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found"
    )


def not_found(path: str) -> APIError:
    return APIError(404, f"No route for {path}", "invalid_request_error", None, "not_found")


def method_not_allowed(method: str, path: str) -> APIError:
    return APIError(405, f"Method {method} not allowed on {path}", "invalid_request_error", None, None)


def service_unavailable(
    message: str = "The server cannot take requests right now; retry later.",
    retry_after_s: int = DEFAULT_RETRY_AFTER_S,
) -> APIError:
    """503 with `Retry-After`: no backend is ready, or it is full."""
    return APIError(
        503,
        message,
        "service_unavailable_error",
        None,
        "service_unavailable",
        {"Retry-After": str(retry_after_s)},
    )


def internal_error(message: str) -> APIError:
    """500: the backend failed on a request the router had accepted."""
    return APIError(500, message, "server_error", None, "internal_error")
