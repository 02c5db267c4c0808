"""DecodeWorker: a request's whole life on the decode side, transport-free.

The gRPC servicer is a thin adapter over ``generate`` / ``abort`` / ``health``. Per request
(one asyncio task, `DecodeFlow`; the engine lives on an `EngineHost`):

1. reserve: ``engine.reserve(key, len(prompt) + 1)``, before the stream exists (out of blocks:
   `DecodeFull`, so the caller can try another decode worker);
2. prefill: expect the transfer's completion (`TransferArrivals`), call the prefill worker with
   the destination blocks covering the prompt; wait for its answer, then poll for the completion;
3. admit: on the engine thread, check the answer's stamp equals the completion's, verify it
   (request id, generation, checksum over the destination blocks), then ``add_prefilled``;
4. decode: the request's stream on the `EngineHost` carries the engine's events until it finishes.

When the router asks for local prefill (``prefill_locally``), steps 1-3 are the engine's own: the
request joins this worker's batch as a prompt, its chunks run beside the other streams' decode steps,
and no transfer is involved.

The engine's request id is ``<request id>@<generation>``, so blocks kept for an old generation can
never be confused with a newer one's.

Blocks reserved for an incoming transfer are freed only when no more bytes can land in them
(DESIGN invariant 2). On abort (client cancel, Abort RPC, shutdown), prefill error or timeout
during stage 2 the flow tells the prefill worker to Abort at once and frees the blocks according
to its answer (`DecodeFlow._give_back`): drained -> now; peer gone -> after a short grace;
otherwise -> after ``prefill_timeout_s``, the timeout both sides agree on
(`glmserve.kv.transfer.timeouts.AGREED.release_s`: the prefill workers' write timeout plus drain
is below it). A transfer that completed is drained by definition.
A completion of an old generation is ignored (stage 2 only accepts the exact pair it expects).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.kv.block_pool import OutOfBlocks
from glmserve.kv.transfer import KVTransferBackend, TransferStamp
from glmserve.services.decode.arrivals import TransferArrivals
from glmserve.services.decode.flow import DecodeFlow
from glmserve.services.decode.flow_context import DecodeSettings, FlowContext
from glmserve.services.decode.prefill_client import PrefillPort
from glmserve.services.engine_host import EngineHost
from glmserve.services.host_metrics import HostTierMetrics
from glmserve.services.host_tier_link import HostTierLink, HostTierSettings
from glmserve.services.liveness import EngineWatch
from glmserve.services.worker_health import WorkerHealth
from glmserve.services.worker_metrics import TokenTimer, WorkerMetrics

if TYPE_CHECKING:
    from glmserve.engine.engine import Engine

log = logging.getLogger(__name__)


class DecodeUnavailable(Exception):
    """The worker cannot take a request now (loading, shutting down, engine thread dead)."""


class DecodeFull(DecodeUnavailable):
    """No KV blocks for this prompt now; another decode worker may have them."""


class DecodeStream:
    """One request's events, in order, ending with exactly one ``finished`` event."""

    def __init__(self, flow: DecodeFlow) -> None:
        self._flow = flow

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._flow.events()

    def abort(self, reason: str = "client cancelled", label: str = "cancelled") -> None:
        """Stop the request now (idempotent); the stream then ends with finish_reason "abort"."""
        self._flow.abort(reason, label)

    @property
    def retryable(self) -> bool:
        """The stream ended with an error before any token, for a reason of the path (its prefill
        worker was unreachable or failed): the caller may try again, here or elsewhere."""
        return self._flow.retryable


class DecodeWorker:
    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        transfer: KVTransferBackend,
        prefill: PrefillPort,
        settings: DecodeSettings | None = None,
        metrics: Callable[[EngineHost], WorkerMetrics] | None = None,
        host_tier: HostTierSettings | None = None,
    ) -> None:
        """``host_tier``: write finished requests' blocks (prompt and generated) through to the kvstore's
        host tier, and demote evicted ones there."""
        self._engine = EngineHost(engine_factory, "decode-engine")
        self._watch = EngineWatch(self._engine)
        self.metrics = metrics(self._engine) if metrics is not None else None
        self.host_metrics = HostTierMetrics(self.metrics.registry) if self.metrics is not None else None
        self._host_tier = HostTierLink(host_tier, transfer, self._engine, self.host_metrics) if host_tier else None
        self._transfer = transfer
        self._prefill = prefill
        self._settings = settings or DecodeSettings()
        self._arrivals = TransferArrivals(self._on_stale)
        self._flows: dict[str, DecodeFlow] = {}  # by request id
        self._context: FlowContext | None = None
        self._draining = self._closing = False

    @property
    def engine(self) -> EngineHost:
        return self._engine

    async def start(self) -> None:
        """Load the engine and register its KV buffer as the transfer destination."""
        self._engine.start()
        await self._engine.loaded()

        buffer, limits = await self._engine.submit(lambda e: (e.kv_buffer, e.limits()))
        self._transfer.register(buffer)
        if self._host_tier is not None:
            await self._host_tier.start(buffer)
        self._context = FlowContext(
            engine=self._engine, prefill=self._prefill, arrivals=self._arrivals,
            settings=self._settings, metrics=self.metrics, transfer=self._transfer,
            target=self._transfer.target_info(), limits=limits,
        )

    def health(self) -> WorkerHealth:
        s = self._engine.snapshot
        return WorkerHealth(self._ready(), s.running, s.waiting + s.reserved, s.free_blocks, s.cache_root, s.block_size)

    def _ready(self) -> bool:
        return self._context is not None and self._engine.alive and not (self._draining or self._closing)

    def ready(self) -> bool:
        """Requests may be sent here (loaded, engine thread alive, not draining)."""
        return self._ready()

    def live(self) -> bool:
        """The process can serve: its engine thread is alive and not stuck (`EngineWatch`)."""
        return self._watch.live()

    # --- requests ---------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, generation: int, prompt_ids: Sequence[int], params: SamplingParams,
        prefill_target: str, cache_salt: str = "", prefill_locally: bool = False,
    ) -> DecodeStream:
        """Reserve the request's blocks and start it. Raises, with nothing held: ``ValueError``
        naming the field for bad input, `DecodeFull` when the blocks are not there, and
        `DecodeUnavailable` when not serving. ``prefill_locally``: this worker's engine computes
        the prompt itself (``prefill_target`` is then unused)."""
        if not self._ready():
            raise DecodeUnavailable("the decode worker is not serving")
        assert self._context is not None
        if request_id in self._flows:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if not prefill_target and not prefill_locally:
            raise ValueError("prefill_target: must be host:port of a prefill worker (or prefill_locally set)")
        self._context.validate(prompt_ids, params)
        timer = TokenTimer(self.metrics) if self.metrics is not None else None
        flow = DecodeFlow(self._context, request_id, generation, list(prompt_ids), params,
                          None if prefill_locally else prefill_target, timer, cache_salt)
        self._flows[request_id] = flow
        try:
            await flow.reserve()
        except OutOfBlocks as e:
            self._forget(flow)
            raise DecodeFull(f"decode worker out of KV blocks: {e}") from None
        except BaseException:  # ValueError, or the caller went away
            self._forget(flow)
            raise
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            if prefill_locally:
                self.metrics.local_prefills.inc()
        flow.start(on_done=self._forget)
        return DecodeStream(flow)

    def abort(self, request_id: str, generation: int, reason: str) -> bool:
        """Abort a running request (its stream ends with "abort"); False if none runs."""
        flow = self._flows.get(request_id)
        if flow is None or flow.generation != generation:
            return False
        flow.abort(reason or "abort", "abort_rpc")
        return True

    def _forget(self, flow: DecodeFlow) -> None:
        self._flows.pop(flow.request_id, None)

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting (Health says not ready; new requests get `DecodeUnavailable`, which the
        router retries elsewhere) and let running requests finish, for up to ``timeout_s``.
        Returns how many still run (`close` ends them)."""
        self._draining = True
        tasks = [f.task for f in self._flows.values() if f.task is not None]
        if tasks and timeout_s > 0:
            await asyncio.wait(tasks, timeout=timeout_s)
        return len(self._flows)

    async def close(self) -> None:
        """End every request (streams end with an error: the request did not finish; prefill
        workers are told), then stop."""
        self._closing = True
        flows = list(self._flows.values())
        for flow in flows:
            flow.abort("the decode worker shut down before the request finished", "shutdown", finish="error")
        if flows:
            await asyncio.wait([f.task for f in flows if f.task is not None], timeout=10.0)
        if self._context is not None:
            self._context.cancel_quarantines()
        if self._host_tier is not None:
            await self._host_tier.close()
        await self._engine.stop()
        self._transfer.close()
        await self._prefill.close()

    # --- hooks ------------------------------------------------------------------------------------

    def _on_stale(self, stamp: TransferStamp, why: str) -> None:
        if self.metrics is not None:
            self.metrics.transfer_stale.inc()
