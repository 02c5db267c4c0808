"""EngineHost: one `Engine` owned by one thread, driven from an asyncio event loop, streaming each
request's `TokenEvent`s to whoever opened its stream. serve-local's backend and both workers host
their engine this way.

The engine is not thread-safe, so exactly one thread ever touches it:

- The thread builds the engine, then loops: run every queued command ``fn(engine)`` (each one's
  result or exception goes back to the loop as an asyncio future), run one ``engine.step()`` when
  there is work, hand the step's events to the loop in one hop (not one per event), where each
  goes to its request's `RequestStream`, and publish an `EngineSnapshot`. With nothing to run it
  blocks on the command queue instead of spinning.
- Commands land between two steps: at most one step late, never mid-step.
- ``open(request_id)`` before the request enters the engine (events of a request without an open
  stream are dropped). ``on_finish(engine, event)``, when given, runs on the engine thread right
  after the step that produced the request's final event, while the engine still holds what the
  request left (a prefill's held blocks); its result is the stream's ``outcome``.
- A step that raises fails the requests the engine runs: each is aborted and its stream ends with an
  "error" event; the thread keeps serving. If the thread itself dies (a bug), every open stream
  ends with "error" and ``alive`` turns False.
- ``stop()`` lets queued commands run, ends the thread, then ends every open stream with "abort".

``snapshot`` (`EngineSnapshot`) is replaced, never mutated: any thread may read it without a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from glmserve.core.generation import FinishReason, TokenEvent
from glmserve.services.engine_snapshot import EngineSnapshot

if TYPE_CHECKING:
    from glmserve.engine.engine import Engine

log = logging.getLogger(__name__)

T = TypeVar("T")
_AnyFuture = asyncio.Future[Any] | concurrent.futures.Future[Any]
OnFinish = Callable[["Engine", TokenEvent], Any]


class RequestStream:
    """One request's events, in order, ending with its final event (iterate once, on the loop).
    ``outcome``: what the stream's ``on_finish`` returned, set before the final event arrives."""

    def __init__(self, request_id: str, forget: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.outcome: Any = None
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._forget = forget
        self._ended = False

    def deliver(self, event: TokenEvent) -> None:
        """Queue ``event`` unless the final event was already queued."""
        if self._ended:
            return
        self._ended = event.finished
        self._events.put_nowait(event)
        if self._ended:
            self._forget(self.request_id)

    def end(self, reason: FinishReason, error: str | None = None) -> None:
        """End the stream now with an event without tokens (no-op once it has ended)."""
        self.deliver(TokenEvent.ended(self.request_id, reason, error))

    def close(self) -> None:
        """Stop receiving events (the consumer leaves); the request itself is not touched."""
        self._ended = True
        self._forget(self.request_id)

    async def next(self) -> TokenEvent:
        return await self._events.get()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self._events.get()
            yield event
            if event.finished:
                return


class EngineHost:
    """See the module docstring. ``start()`` on the event loop; ``loaded()`` awaits the engine."""

    def __init__(self, factory: Callable[[], Engine], name: str = "engine") -> None:
        self._factory = factory
        self._name = name
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], _AnyFuture | None] | None]
        self._commands = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._finishers: dict[str, OnFinish] = {}  # set on the loop before the request is added
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loaded: asyncio.Future[None] | None = None
        self.snapshot = EngineSnapshot()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    async def loaded(self) -> None:
        """Returns once the engine is built; raises what building it raised."""
        assert self._loaded is not None, "start() first"
        await asyncio.shield(self._loaded)

    @property
    def is_loaded(self) -> bool:
        return self._loaded is not None and self._loaded.done() and self._loaded.exception() is None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # --- requests (event loop) --------------------------------------------------------------------

    def open(self, request_id: str, on_finish: OnFinish | None = None) -> RequestStream:
        """The stream of ``request_id``'s events; open it before the request enters the engine."""
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} already has an open stream")
        stream = self._streams[request_id] = RequestStream(request_id, self._forget)
        if on_finish is not None:
            self._finishers[request_id] = on_finish
        return stream

    def abort(self, request_id: str, reason: str | None = None) -> None:
        """Stop the request in the engine (its blocks are free when the command runs); its open
        stream then ends with "abort" (unless its final event came first)."""

        def abort(engine: Engine) -> None:
            engine.abort(request_id)
            self._finishers.pop(request_id, None)
            self.post(self._end, request_id, "abort", reason)

        self.submit_nowait(abort)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._finishers.pop(request_id, None)

    def _end(self, request_id: str, reason: FinishReason, error: str | None) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.end(reason, error)

    def _route(self, events: list[TokenEvent], outcomes: dict[str, Any]) -> None:
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is not None:
                if event.request_id in outcomes:
                    stream.outcome = outcomes[event.request_id]
                stream.deliver(event)

    def _fail_all(self, message: str) -> None:
        for stream in list(self._streams.values()):
            stream.end("error", message)

    # --- commands ---------------------------------------------------------------------------------

    def submit(self, fn: Callable[[Engine], T]) -> asyncio.Future[T]:
        """Run ``fn(engine)`` on the engine thread between two steps; the future (on the loop)
        gets its result or exception. The command runs even if nobody awaits the future any more."""
        assert self._loop is not None, "start() first"
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put((fn, future))
        return future

    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """`submit` for callers on any thread (tests, stats): a `concurrent.futures.Future`."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    def submit_nowait(self, fn: Callable[[Engine], Any]) -> None:
        """Run ``fn(engine)`` between two steps; nobody waits for it (exceptions are logged)."""
        self._commands.put((fn, None))

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` on the event loop (from the engine thread)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def stop(self) -> None:
        """Let queued commands run, end the thread, then end every open stream with "abort"."""
        if self._thread is not None:
            self._commands.put(None)
            await asyncio.to_thread(self._thread.join)
        for stream in list(self._streams.values()):
            stream.end("abort", "the engine stopped")

    # --- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as e:  # surfaced through loaded()
            log.exception("engine failed to load")
            self.post(_settle, self._loaded, None, e)
            return
        try:
            self.snapshot = EngineSnapshot.of(engine)
            self.post(_settle, self._loaded, None, None)
            while self._drain(engine, block=not engine.has_unfinished()):
                if engine.has_unfinished():
                    self._step(engine)
                self.snapshot = EngineSnapshot.of(engine)
        except BaseException as e:  # a bug: no stream may wait forever on a dead thread
            log.exception("engine thread died")
            self.post(self._fail_all, f"the engine thread died: {e!r}")
            raise

    def _drain(self, engine: Engine, block: bool) -> bool:
        """Run queued commands (waiting for one when ``block``); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while command is not None:
            fn, future = command
            try:
                result, error = fn(engine), None
            except Exception as e:  # handed to whoever submitted it
                result, error = None, e
                if future is None:
                    log.exception("engine command failed")
            if isinstance(future, concurrent.futures.Future):
                _settle(future, result, error)
            elif future is not None:
                self.post(_settle, future, result, error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _step(self, engine: Engine) -> None:
        try:
            events = engine.step()
        except Exception as e:  # a bug or an exhausted resource: fail what runs, keep serving
            failed = engine.abort_all()
            log.exception("engine step failed; %d requests aborted", len(failed))
            message = f"engine step failed: {e!r}"
            self.post(self._route, [TokenEvent.ended(r, "error", message) for r in failed], {})
            return
        if not events:
            return
        outcomes = {}
        for event in events:
            finish = self._finishers.pop(event.request_id, None) if event.finished else None
            if finish is not None:
                try:
                    outcomes[event.request_id] = finish(engine, event)
                except Exception:  # the stream ends as usual, without an outcome
                    log.exception("on_finish of %s failed", event.request_id)
        self.post(self._route, events, outcomes)


def _settle(future: _AnyFuture | None, result: Any, error: BaseException | None) -> None:
    """Complete ``future`` on the loop unless its waiter already gave up on it."""
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
