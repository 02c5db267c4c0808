"""RequestIdMiddleware: every HTTP answer carries an ``x-request-id`` header: the client's own
(accepted when it is 1-128 printable ASCII characters, as proxies and SDKs send them) or a new
one. Routes read it as ``request.state.request_id``; the serving layer puts it in its log lines.

A pure ASGI middleware (it only wraps ``send``): it leaves the receive channel alone, so streaming
and the client-disconnect watch work exactly as without it.
"""

from __future__ import annotations

import uuid
from typing import Any

HEADER = b"x-request-id"
MAX_LEN = 128


def accepted_request_id(value: str | None) -> str:
    """The client's id if acceptable, else a fresh one."""
    if value and len(value) <= MAX_LEN and value.isascii() and value.isprintable():
        return value
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or []).get(HEADER)
        request_id = accepted_request_id(sent.decode("latin-1") if sent is not None else None)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
