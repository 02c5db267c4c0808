"""EngineThread: one `Engine` owned by one thread, driven from an asyncio event loop.

The engine is not thread-safe, so exactly one thread ever touches it (the pattern of the router's
``LocalEngineBackend``, shared by the prefill and decode workers):

- The thread builds the engine, then loops: run every queued command ``fn(engine)`` (each one's
  result or exception goes back to the loop as an asyncio future), run one ``engine.step()`` when
  there is work, hand the step's outputs to ``on_step`` (called on this thread, so it may read the
  engine; it posts what it learned to the loop itself), and publish an `EngineSnapshot`.
  With nothing to run it blocks on the command queue instead of spinning.
- Commands land between two steps: at most one step late, never mid-step.
- A step that raises is handed to ``on_step_error`` (on this thread); the loop keeps serving.

``snapshot`` is replaced, never mutated, so any thread may read it without a lock (Health and the
metrics collector read it while a step runs).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from glmserve.core.generation import TokenEvent

if TYPE_CHECKING:
    from glmserve.engine.engine import Engine

log = logging.getLogger(__name__)

T = TypeVar("T")
StepHook = Callable[["Engine", list[TokenEvent]], None]
ErrorHook = Callable[["Engine", BaseException], None]


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters after the thread's latest loop iteration (immutable)."""

    loaded: bool = False
    running: int = 0
    waiting: int = 0
    held: int = 0  # prefill: finished requests whose blocks wait for their transfer
    reserved: int = 0  # decode: reservations waiting for their KV
    free_blocks: int = 0
    used_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 0
    cache_root: bytes = b""  # prefix-cache root hash (empty: caching off); the router hashes with it
    prompt_tokens: int = 0
    generated_tokens: int = 0
    acceptance_lengths: dict[int, int] = field(default_factory=dict)
    draft_lengths: dict[int, int] = field(default_factory=dict)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0

    @classmethod
    def of(cls, engine: Engine) -> EngineSnapshot:
        stats = engine.stats
        return cls(
            loaded=True,
            running=len(engine.scheduler.running),
            waiting=engine.scheduler.num_waiting,
            held=len(engine.held),
            reserved=len(engine.reserved),
            free_blocks=engine.pool.num_free,
            used_blocks=engine.pool.num_used,
            total_blocks=engine.pool.num_blocks,
            block_size=engine.config.block_size,
            cache_root=engine.kv.root_hash or b"",
            prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.generated_tokens,
            acceptance_lengths=dict(stats.acceptance_lengths),
            draft_lengths=dict(stats.draft_lengths),
            draft_tokens=stats.draft_tokens,
            accepted_tokens=stats.accepted_tokens,
            preemptions=engine.scheduler.num_preemptions,
            evictions=engine.pool.num_evictions,
        )


class EngineThread:
    """See the module docstring. ``start()`` on the event loop; ``loaded()`` awaits the engine."""

    def __init__(
        self,
        factory: Callable[[], Engine],
        on_step: StepHook | None = None,
        on_step_error: ErrorHook | None = None,
        name: str = "engine",
        snapshot_of: Callable[[Any], EngineSnapshot] = EngineSnapshot.of,
    ) -> None:
        """``snapshot_of``: how to read the counters of what ``factory`` builds (another engine
        kind, e.g. a LayerSplit stage, brings its own)."""
        self._factory = factory
        self._snapshot_of = snapshot_of
        self._on_step = on_step
        self._on_step_error = on_step_error
        self._name = name
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], asyncio.Future[Any] | None] | None]
        self._commands = queue.SimpleQueue()
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
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, fn: Callable[[Engine], T]) -> asyncio.Future[T]:
        """Run ``fn(engine)`` on the engine thread between two steps; the future (on the loop)
        gets its result or exception. The command runs even if nobody awaits the future any more."""
        assert self._loop is not None, "start() first"
        future: asyncio.Future[T] = self._loop.create_future()
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
        """Let queued commands run, then end the thread."""
        if self._thread is None:
            return
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join)

    # --- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as e:  # surfaced through loaded()
            log.exception("engine failed to load")
            self.post(_settle, self._loaded, None, e)
            return
        self.snapshot = self._snapshot_of(engine)
        self.post(_settle, self._loaded, None, None)
        while self._drain(engine, block=not engine.has_unfinished()):
            if engine.has_unfinished():
                self._step(engine)
            self.snapshot = self._snapshot_of(engine)

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
            if future is not None:
                self.post(_settle, future, result, error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _step(self, engine: Engine) -> None:
        try:
            outputs = engine.step()
        except Exception as e:  # a bug or an exhausted resource: the hook fails what runs
            log.exception("engine step failed")
            if self._on_step_error is not None:
                self._on_step_error(engine, e)
            return
        if self._on_step is not None and outputs:
            self._on_step(engine, outputs)


def _settle(future: asyncio.Future[Any] | None, result: Any, error: BaseException | None) -> None:
    """Complete ``future`` on the loop unless its waiter already gave up on it."""
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
