"""One access-log line per HTTP request, on the logger ``glmserve.access``:

    POST /v1/chat/completions 200 prompt_tokens=12 completion_tokens=40 0.832s

method, path, status (499: the client left before an answer started), the prompt and generated
tokens of a generation request ("-" when it ran nothing), and the time until the answer's last byte
(a stream's whole length). Never a prompt's or an answer's text, a query string or a header. The
routes leave the request's run in ``request.state.run`` for its token counts.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("glmserve.access")


class AccessLog:
    """ASGI middleware writing the line above when a request's answer is done."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.monotonic(), 499

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            run: Any = scope.get("state", {}).get("run")
            prompt, generated = (len(run.prompt_ids), run.output.num_generated) if run is not None else ("-", "-")
            log.info("%s %s %d prompt_tokens=%s completion_tokens=%s %.3fs", scope["method"], scope["path"],
                     status, prompt, generated, time.monotonic() - started)
