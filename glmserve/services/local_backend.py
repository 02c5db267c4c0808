"""LocalEngineBackend: the router's `GenerationBackend` over one in-process engine (serve-local).

The engine runs on an `EngineHost` (its own thread); each request is a stream of that host. torch
is imported only when the engine is built here, so the router package stays torch-free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.services.engine_host import EngineHost, RequestStream
from glmserve.services.router.backend import BackendUnavailable, GenerationBackend, RequestHints

if TYPE_CHECKING:
    from glmserve.engine.engine import Engine

# Requests admitted at once (queued or running) before ready() says no and the router answers 503.
DEFAULT_MAX_PENDING = 256


class LocalEngineBackend(GenerationBackend):
    """`GenerationBackend` over one local `Engine` hosted by an `EngineHost`."""

    def __init__(self, engine_factory: Callable[[], Engine], max_pending: int = DEFAULT_MAX_PENDING):
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        self.host = EngineHost(engine_factory, "engine-loop")
        self._max_pending = max_pending
        self._started = self._closed = False

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, max_pending: int = DEFAULT_MAX_PENDING, **engine_config: Any
    ) -> LocalEngineBackend:
        """A backend whose engine thread loads ``model_dir`` (``engine_config``: `EngineConfig` fields)."""

        def build() -> Engine:
            from glmserve.engine.engine import Engine  # torch: only in the process that runs the engine

            return Engine.from_model_dir(model_dir, **engine_config)

        return cls(build, max_pending)

    async def start(self) -> None:
        if not self._started:
            self._started = True
            self.host.start()  # ready() turns True once the engine is loaded

    async def close(self) -> None:
        if self._started and not self._closed:
            self._closed = True
            await self.host.stop()  # open streams end with "abort"

    def _serving(self) -> bool:
        return self.host.is_loaded and self.host.alive and not self._closed

    def ready(self) -> bool:
        return self._serving() and self.host.num_streams < self._max_pending

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        hints: RequestHints | None = None,
    ) -> AsyncIterator[TokenEvent]:
        if not self._serving():
            raise BackendUnavailable("the engine is not running")
        stream = self.host.open(request_id)
        salt = hints.cache_salt if hints is not None else None  # one engine: no placement to steer
        prompt = list(prompt_ids)
        added = self.host.submit(lambda e: e.add_request(request_id, prompt, params, cache_salt=salt))
        added.add_done_callback(lambda f: _end_if_refused(stream, f))
        finished = False
        try:
            async for event in stream:
                finished = event.finished
                yield event
        finally:
            if not finished:  # the consumer left early: free the engine's blocks now
                stream.close()
                self.host.abort(request_id)

    async def abort(self, request_id: str) -> None:
        self.host.abort(request_id)

    def call_in_engine(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn(engine)`` on the engine thread between two steps (for stats and tests; any thread)."""
        return self.host.call(fn)


def _end_if_refused(stream: RequestStream, added: asyncio.Future[Any]) -> None:
    """The engine refused the request (``ValueError`` naming the field): its stream ends with "error"."""
    if not added.cancelled() and added.exception() is not None:
        stream.end("error", str(added.exception()))
