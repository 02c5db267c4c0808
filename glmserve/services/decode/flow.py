"""DecodeFlow: one decode request, from block reservation to its last token (one asyncio task).

The stages and the rule for freeing destination blocks are in `glmserve.services.decode.worker`'s
docstring. Aborts never cancel the task: ``abort`` sets an event the flow waits on next to whatever
it awaits (and puts a final "abort" event in its output queue), so every cleanup step runs to its end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from glmserve.core.generation import FinishReason, SamplingParams, TokenEvent
from glmserve.kv.transfer import StaleTransferError, StampError, TransferStamp, verify_stamp
from glmserve.services.decode.flow_context import FlowContext
from glmserve.services.decode.prefill_client import (
    AbortAnswer,
    PrefillAnswer,
    PrefillCall,
    PrefillCallError,
)
from glmserve.services.engine_host import RequestStream
from glmserve.services.worker_metrics import TokenTimer

if TYPE_CHECKING:
    from glmserve.engine.engine import Engine

log = logging.getLogger(__name__)


class _Ended(Exception):
    """The flow ends early: ``reason`` "abort" or "error", ``error`` what happened; ``retryable``:
    before any token, for a reason of the path, not of the request (its prefill worker could not
    be reached or failed, the transfer did not arrive): another attempt may well succeed."""

    def __init__(self, reason: FinishReason, error: str | None, retryable: bool = False) -> None:
        super().__init__(error or reason)
        self.reason, self.error, self.retryable = reason, error, retryable


class DecodeFlow:
    def __init__(self, ctx: FlowContext, request_id: str, generation: int, prompt_ids: list[int],
                 params: SamplingParams, prefill_target: str | None, timer: TokenTimer | None,
                 cache_salt: str = "") -> None:
        """``prefill_target`` None: this worker prefills the prompt itself (the router chose local
        prefill), so there is no reservation, no Prefill call and no transfer."""
        self._ctx = ctx
        self.cache_salt = cache_salt  # tenant prefix-cache salt, for prefill and our own commits
        self.request_id, self.generation = request_id, generation
        self.key = f"{request_id}@{generation}"  # the engine's request id
        self._prompt, self._params, self._target, self._timer = prompt_ids, params, prefill_target, timer
        self._stream: RequestStream | None = None  # the engine's events, once admitted
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._aborted = asyncio.Event()
        self._abort_reason: str | None = None
        self._abort_finish: FinishReason = "abort"
        self.stage = "queued"  # queued (reserving) | prefill | decode | done
        self.num_cached = 0
        self.retryable = False  # it ended before any token for a reason of the path (`_Ended`)
        self.task: asyncio.Task[None] | None = None
        self._dest: list[int] = []  # the reserved blocks covering the prompt
        self.local = prefill_target is None

    def start(self, on_done: Callable[[DecodeFlow], None]) -> None:
        self.task = asyncio.create_task(self._run(on_done), name=f"decode-{self.key}")

    def abort(self, reason: str, label: str, finish: FinishReason = "abort") -> None:
        """Stop the request; its stream ends with ``finish`` ("abort", or "error" when the
        request was not given up by anyone but cannot finish here: the worker shuts down)."""
        if self._abort_reason is not None or self.stage == "done":
            return
        self._abort_reason, self._abort_finish = reason, finish
        if self._ctx.metrics is not None:
            self._ctx.metrics.abort(self.stage, label)
        self._aborted.set()
        if self._stream is not None:
            self._stream.end(finish, reason)

    async def events(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self._events.get()
            yield event
            if event.finished:
                return

    async def _run(self, on_done: Callable[[DecodeFlow], None]) -> None:
        try:
            final = await self._decode(await (self._prefill_here() if self.local else self._prefill()))
        except _Ended as e:
            self.retryable = e.retryable and self._abort_reason is None
            final = self._final(e.reason, e.error)
        except Exception as e:  # a bug: end the stream; blocks in an unknown state wait out the backstop
            log.exception("decode request %s failed", self.key)
            if self.stage == "decode" or self.local:
                self._ctx.engine.submit_nowait(lambda eng: eng.abort(self.key))
            else:
                self._ctx.release_later(self.key, self._ctx.settings.prefill_timeout_s)
            final = self._final("error", f"internal error: {e!r}")
        finally:
            self.stage = "done"
            if self._stream is not None:
                self._stream.close()
            on_done(self)
        if self._timer is not None:
            self._timer.finish()
        self._events.put_nowait(final)

    def _final(self, reason: FinishReason, error: str | None) -> TokenEvent:
        return TokenEvent.ended(self.key, reason, error, self.num_cached)

    def _abort_ended(self) -> _Ended | None:
        return None if self._abort_reason is None else _Ended(self._abort_finish, self._abort_reason)

    # --- stages -----------------------------------------------------------------------------------

    async def reserve(self) -> None:
        """Stage 1, before the stream exists: raises ``OutOfBlocks`` (the worker is full) or
        ``ValueError`` (this request id and generation still hold blocks), holding nothing then.
        A caller cancelled meanwhile leaves nothing behind either."""
        if self.local:  # the engine allocates as it prefills (and queues the request until it can)
            return
        n = len(self._prompt)
        reserved = self._ctx.engine.submit(lambda e: e.reserve(self.key, n + 1))
        try:
            blocks = await asyncio.shield(reserved)
        except asyncio.CancelledError:
            reserved.add_done_callback(self._release_if_reserved)
            raise
        self._dest = blocks[: -(-n // self._ctx.limits.block_size)]

    def _release_if_reserved(self, reserved: asyncio.Future[list[int]]) -> None:
        if not reserved.cancelled() and reserved.exception() is None:
            self._ctx.release_now(self.key)

    async def _prefill(self) -> TokenEvent:
        """Stages 2 and 3; the first token's event."""
        ctx, s, dest = self._ctx, self._ctx.settings, self._dest
        if self._abort_reason is not None:
            ctx.release_now(self.key)  # nothing was asked of any prefill worker yet
            raise _Ended(self._abort_finish, self._abort_reason)
        self.stage = "prefill"
        if self._timer is not None:
            self._timer.scheduled()
        arrival = ctx.arrivals.expect(self.request_id, self.generation)
        with ctx.transfer.expecting_writes():  # until the write is final or given back
            call = asyncio.create_task(ctx.prefill.prefill(self._target, PrefillCall(
                self.request_id, self.generation, self._prompt, self._params, ctx.target, dest,
                ctx.transfer.kind, s.checksum, self.cache_salt), s.prefill_timeout_s))
            await _first(call, self._aborted, s.prefill_timeout_s + 1.0)  # the call has its own deadline
            if not call.done() or call.exception() is not None:
                ctx.arrivals.forget(self.request_id, self.generation)
                ended = self._abort_ended() or _ended_for(call, self._target)
                await self._give_back(call, ended.error or ended.reason)
                raise ended
            answer = call.result()
            await self._await_arrival(arrival)
        ctx.arrivals.forget(self.request_id, self.generation)
        if not arrival.done() or arrival.cancelled():
            ctx.release_now(self.key)  # the writer saw the write done: nothing more lands
            raise self._abort_ended() or _Ended("error", "the KV transfer's completion did not arrive "
                                                       f"within {s.arrival_timeout_s}s", retryable=True)
        stamps, params, prompt = arrival.result(), self._params, self._prompt
        self._stream = ctx.engine.open(self.key)  # before the request is in the engine
        try:
            first = await ctx.engine.submit(lambda e: _admit(e, self, prompt, params, dest, stamps, answer,
                                                             s.checksum))
        except (StampError, ValueError) as e:  # _admit released the blocks
            ctx.transfer_failed("stamp")
            raise _Ended("error", f"KV transfer rejected: {e}") from None
        self.num_cached = answer.output.num_cached_tokens
        return first

    async def _prefill_here(self) -> TokenEvent:
        """Stages 2 and 3 on this worker's own engine: the request joins the batch as a prompt, and
        its chunks run beside the other streams' decode steps. The first token's event."""
        if self._abort_reason is not None:
            raise _Ended(self._abort_finish, self._abort_reason)
        self.stage = "prefill"
        if self._timer is not None:
            self._timer.scheduled()
        prompt, params, salt = self._prompt, self._params, self.cache_salt or None
        self._stream = self._ctx.engine.open(self.key)  # before the request is in the engine
        try:
            await self._ctx.engine.submit(lambda e: e.add_request(self.key, prompt, params, cache_salt=salt))
        except ValueError as e:  # the sampling parameters cannot apply here (a grammar that does not compile)
            raise _Ended("error", f"invalid request: {e}") from None
        if self._abort_reason is not None:  # aborted while joining: the stream already ended
            self._ctx.engine.submit_nowait(lambda e: e.abort(self.key))
            raise _Ended(self._abort_finish, self._abort_reason)
        first = await self._stream.next()
        self.num_cached = first.num_cached_tokens
        return first

    async def _await_arrival(self, arrival: asyncio.Future[tuple[TransferStamp, ...]]) -> None:
        """Poll for the completion until it arrived, the flow is aborted or the wait timed out."""
        ctx, loop = self._ctx, asyncio.get_running_loop()
        deadline = loop.time() + ctx.settings.arrival_timeout_s
        while True:
            ctx.poll_completions()
            if arrival.done() or self._aborted.is_set() or loop.time() > deadline:
                return
            await asyncio.sleep(ctx.settings.poll_interval_s)

    async def _give_back(self, call: asyncio.Task[PrefillAnswer], why: str) -> None:
        """Tell the prefill worker to stop at once, then free the blocks when nothing more lands."""
        ctx, s = self._ctx, self._ctx.settings
        call.add_done_callback(_consume)
        error = call.exception() if call.done() else None
        if isinstance(error, PrefillCallError) and error.drained:
            ctx.release_now(self.key)
            return
        answer = await ctx.prefill.abort(self._target, self.request_id, self.generation, why, s.prefill_timeout_s)
        call.cancel()
        if answer is AbortAnswer.DRAINED:
            ctx.release_now(self.key)
            return
        if answer is AbortAnswer.PEER_GONE:
            ctx.transfer_failed("peer_gone")
            ctx.release_later(self.key, s.dead_peer_grace_s)
            return
        ctx.transfer_failed("not_drained")
        log.warning("%s: prefill worker %s could not confirm the transfer drained (%s); blocks "
                    "quarantined for %.0fs", self.key, self._target, answer.value, s.prefill_timeout_s)
        ctx.release_later(self.key, s.prefill_timeout_s)

    async def _decode(self, out: TokenEvent) -> TokenEvent:
        """Forward the engine's events until the last one, which is returned."""
        self.stage = "decode"
        assert self._stream is not None
        while True:
            if out.finish_reason == "abort" or (out.finish_reason == "error" and self._abort_reason is not None):
                # aborted here (the engine's own events never say abort; a shutdown ends with "error")
                await self._ctx.engine.submit(lambda e: e.abort(self.key))  # frees its blocks now
                return self._final(out.finish_reason, out.error)
            if out.finish_reason == "error":
                return self._final("error", out.error)
            if self._timer is not None:
                self._timer.on_tokens(len(out.token_ids))
            if out.finished:
                return out
            if out.token_ids:
                self._events.put_nowait(out)
            out = await self._stream.next()


def _admit(engine: Engine, flow: DecodeFlow, prompt: list[int], params: SamplingParams, dest: list[int],
           stamps: tuple[TransferStamp, ...], answer: PrefillAnswer, checksum: bool) -> TokenEvent:
    """On the engine thread: verify the transfer, then join the request to the batch. Frees the
    reserved blocks and raises when the transfer must not be used."""
    key = flow.key
    try:
        _verify_transfer(engine, flow, dest, stamps, answer, checksum)
        return engine.add_prefilled(key, prompt, params, answer.output, cache_salt=flow.cache_salt)
    except (StampError, ValueError):
        engine.release(key)
        raise


def _verify_transfer(engine: Engine, flow: DecodeFlow, dest: list[int], stamps: tuple[TransferStamp, ...],
                     answer: PrefillAnswer, checksum: bool) -> None:
    """The answer names the transfer that arrived: one write (its stamp), or one part per chunk of
    each of ``num_stages`` stages (a LayerSplit replica); each stamp verifies on its own blocks."""
    replied = TransferStamp.decode(answer.stamp)
    parts = [st.part for st in stamps if st.part is not None]
    if not parts and replied != stamps[0]:
        raise StaleTransferError(f"the prefill answer's stamp {replied} is not the completion's {stamps[0]}")
    if parts and ((replied.request_id, replied.generation) != (flow.request_id, flow.generation)
                  or parts[0].stages != answer.num_stages):
        raise StaleTransferError(f"the prefill answer {replied} ({answer.num_stages} stages) does not name the "
                                 f"{parts[0].stages}-stage transfer that arrived")
    for st in stamps:
        if checksum and st.checksum is None:
            raise StampError("a checksum was asked for but the transfer carries none")
        blocks = dest if st.part is None else dest[st.part.first_block : st.part.first_block + st.part.num_blocks]
        verify_stamp(st, request_id=flow.request_id, generation=flow.generation, buffer=engine.kv_buffer,
                     block_ids=blocks)


async def _first(future: asyncio.Future[Any], event: asyncio.Event, timeout_s: float) -> None:
    """Wait until ``future`` is done, ``event`` is set or ``timeout_s`` passed; never cancels ``future``."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({future, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _ended_for(call: asyncio.Task[PrefillAnswer], target: str) -> _Ended:
    """How a stream ends when its Prefill call did not answer: "abort" when the prefill side
    aborted it (an abort started there reaches the client too), else "error" naming the failure."""
    if not call.done():
        return _Ended("error", f"prefill worker {target} did not answer in time", retryable=True)
    error = call.exception()
    if isinstance(error, PrefillCallError) and error.code == "aborted":
        return _Ended("abort", f"prefill worker {target}: {error}")
    if isinstance(error, PrefillCallError) and error.code == "unavailable":
        return _Ended("error", f"prefill worker {target} failed or is unreachable: {error}", retryable=True)
    # "invalid" is the request's own fault (the router answers 400); anything else may pass
    invalid = isinstance(error, PrefillCallError) and error.code == "invalid"
    return _Ended("error", f"prefill worker {target}: {error}", retryable=not invalid)


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning
