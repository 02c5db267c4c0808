"""LocalEngineBackend: one in-process `Engine` driven by one background thread.

Threading model (the engine is not thread-safe, so exactly one thread ever touches it):

- The engine thread builds the engine, then loops: drain the command queue (add / abort / call),
  run one ``engine.step()``, hand each output to the event loop with ``call_soon_threadsafe``.
  With nothing to run it blocks on the command queue instead of spinning.
- The event loop owns the per-request ``asyncio.Queue``s; it only talks to the engine through the
  command queue. Aborts therefore land between two steps: at most one step late, never mid-step.

torch is imported only when an engine is built here, so the router package stays torch-free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.services.router.backend import (
    BackendUnavailable,
    GenerationBackend,
    RequestHints,
)

if TYPE_CHECKING:
    from glmserve.engine.engine import Engine

log = logging.getLogger(__name__)

# Requests admitted at once (queued or running) before ready() says no and the router answers 503.
DEFAULT_MAX_PENDING = 256


class LocalEngineBackend(GenerationBackend):
    """`GenerationBackend` over one local `Engine` (see the module docstring for the threading)."""

    def __init__(self, engine_factory: Callable[[], Engine], max_pending: int = DEFAULT_MAX_PENDING):
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        self._factory = engine_factory
        self._max_pending = max_pending
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[TokenEvent]] = {}  # event-loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._closed = False
        self.load_error: BaseException | None = None

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, max_pending: int = DEFAULT_MAX_PENDING, **engine_config: Any
    ) -> LocalEngineBackend:
        """A backend whose engine thread loads ``model_dir`` (``engine_config``: `EngineConfig` fields)."""

        def build() -> Engine:
            from glmserve.engine.engine import Engine  # torch: only in the process that runs the engine

            return Engine.from_model_dir(model_dir, **engine_config)

        return cls(build, max_pending)

    # --- GenerationBackend ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        if self._thread is None or self._closed:
            return
        self._closed = True
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join)
        for request_id in list(self._streams):
            self._deliver(TokenEvent.ended(request_id, "abort"))

    def ready(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive() and not self._closed
        return alive and self._loaded.is_set() and len(self._streams) < self._max_pending

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        hints: RequestHints | None = None,
    ) -> AsyncIterator[TokenEvent]:
        if not self._loaded.is_set() or self._closed or not self._thread.is_alive():
            raise BackendUnavailable("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._streams[request_id] = events
        salt = hints.cache_salt if hints is not None else None  # one engine: no placement to steer
        self._commands.put(("add", request_id, list(prompt_ids), params, salt))
        finished = False
        try:
            while not finished:
                event = await events.get()
                finished = event.finished
                yield event
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the consumer left early: free the engine's blocks now
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def call_in_engine(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn(engine)`` on the engine thread between two steps (for stats and tests)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(("call", fn, future))
        return future

    # --- event-loop side --------------------------------------------------------------------------

    def _deliver(self, event: TokenEvent) -> None:
        stream = self._streams.get(event.request_id)
        if stream is not None:  # None: the consumer already left; its abort is queued
            stream.put_nowait(event)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._streams):
            self._deliver(TokenEvent.ended(request_id, "error", message))

    def _post(self, event: TokenEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # --- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as e:  # surfaced through ready() staying False
            log.exception("engine failed to load")
            self.load_error = e
            return
        self._loaded.set()
        live: set[str] = set()  # ids of the requests in the engine
        try:
            while self._drain(engine, live, block=not engine.has_unfinished()):
                if engine.has_unfinished():
                    self._step(engine, live)
        except BaseException as e:  # a bug: no stream may wait forever on a dead thread
            log.exception("engine loop died")
            self._loop.call_soon_threadsafe(self._fail_all, repr(e))
            raise

    def _drain(self, engine: Engine, live: set[str], block: bool) -> bool:
        """Apply queued commands (waiting for one when ``block``); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(engine, live, *command[1:])
            elif kind == "abort":
                if engine.abort(command[1]) or command[1] in live:
                    live.discard(command[1])
                    self._post(TokenEvent.ended(command[1], "abort"))
            elif kind == "call":
                _, fn, future = command
                try:
                    future.set_result(fn(engine))
                except BaseException as e:  # handed to the caller
                    future.set_exception(e)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(
        self,
        engine: Engine,
        live: set[str],
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
    ) -> None:
        try:
            engine.add_request(request_id, prompt_ids, params, cache_salt=cache_salt)
            live.add(request_id)
        except ValueError as e:
            self._post(TokenEvent.ended(request_id, "error", str(e)))

    def _step(self, engine: Engine, live: set[str]) -> None:
        try:
            events = engine.step()
        except Exception as e:  # a bug or an exhausted resource: fail what runs, keep serving
            log.exception("engine step failed; aborting %d running requests", len(live))
            for request_id in list(live):
                engine.abort(request_id)
                self._post(TokenEvent.ended(request_id, "error", repr(e)))
            live.clear()
            return
        for event in events:
            if event.finished:
                live.discard(event.request_id)
            self._post(event)
