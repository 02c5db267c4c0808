"""What ``/openapi.json`` says the router answers, besides a 200: the OpenAI error object with the
statuses each kind of route can give, the SSE content type of a streamed answer, and the text of
``/metrics``. Clients and schema-driven tests (schemathesis) check answers against it.
"""

from __future__ import annotations

from typing import Any

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "integer", "null"]},
        },
    }},
}
SSE_EVENT: dict[str, Any] = {  # one event of a streamed answer (its data: a JSON chunk, or [DONE])
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before trying again",
                                "schema": {"type": "string"}}}
_WHY = {
    400: "invalid request (the message names the field or parameter)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    429: "overloaded: the queue is full, or the request waited too long for a place",
    503: "draining, or no healthy worker of a role",
}
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503)
TOKENIZER_ERRORS = (400, 401, 404, 413)
LISTING_ERRORS = (401, 404)


def document_answers(schema: dict[str, Any], generation_paths: set[str]) -> None:
    """Add the answers to ``schema`` (FastAPI's, in place): ``generation_paths`` stream SSE when
    asked and give every error status above; the others give what their kind of route can."""
    schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if path in generation_paths:
                statuses = GENERATION_ERRORS
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {}).setdefault("text/event-stream", {"schema": SSE_EVENT})
            elif path in ("/tokenize", "/detokenize"):
                statuses = TOKENIZER_ERRORS
            elif path.startswith("/v1/"):
                statuses = LISTING_ERRORS
            elif path == "/ready":
                statuses = (503,)
            else:
                statuses = ()
            # Bad path or query parameters are the OpenAI 400, never FastAPI's 422.
            responses.pop("422", None)
            if any(p.get("in") == "query" for p in operation.get("parameters", [])):
                statuses = (400, *statuses)
            if path == "/metrics":
                responses["200"] = {"description": "Prometheus text format",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}
            for status in statuses:
                responses[str(status)] = _error_response(status)


def _error_response(status: int) -> dict[str, Any]:
    answer: dict[str, Any] = {"description": _WHY[status], "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    if status in (429, 503):
        answer["headers"] = _RETRY_AFTER
    return answer
