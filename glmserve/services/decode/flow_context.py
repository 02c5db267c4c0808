"""FlowContext: what every `DecodeFlow` of one decode worker shares, and the block-freeing helpers
(now, or after a quarantine while a writer we cannot hear from may still write)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from glmserve.core.generation import SamplingParams, check_prompt
from glmserve.engine.engine_stats import EngineLimits
from glmserve.kv.transfer import KVTransferBackend
from glmserve.kv.transfer.timeouts import AGREED
from glmserve.services.decode.arrivals import TransferArrivals
from glmserve.services.decode.prefill_client import PrefillPort
from glmserve.services.engine_host import EngineHost
from glmserve.services.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeSettings:
    prefill_timeout_s: float = AGREED.release_s  # Prefill call deadline; quarantine of undrained blocks
    arrival_timeout_s: float = 5.0  # after the Prefill answer, how long the completion may lag
    dead_peer_grace_s: float = 1.0  # a gone prefill worker: until its last bytes surely landed
    checksum: bool = False  # ask prefill workers to stamp transfers with a checksum
    poll_interval_s: float = 0.001  # completion polling between a Prefill answer and its arrival

    def __post_init__(self) -> None:
        for name in ("prefill_timeout_s", "arrival_timeout_s", "dead_peer_grace_s", "poll_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")


@dataclass
class FlowContext:
    """What every flow of one worker shares (set up once the engine is loaded)."""

    engine: EngineHost
    prefill: PrefillPort
    arrivals: TransferArrivals
    settings: DecodeSettings
    metrics: WorkerMetrics | None
    transfer: KVTransferBackend  # this worker's (the receiving side)
    target: bytes  # its target_info()
    limits: EngineLimits
    quarantined: set[asyncio.TimerHandle] = field(default_factory=set)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        check_prompt(list(prompt_ids), params, self.limits.vocab_size, self.limits.max_positions)

    def poll_completions(self) -> None:
        """Hand every completion that arrived to the flow expecting it (stale ones are dropped).

        Polled only by flows whose Prefill answered (the writer saw its write done, so the
        completion is there or about to be): no polling while prefills compute."""
        try:
            stamps = self.transfer.completions()
        except Exception:  # the flow waiting for it times out if this persists
            log.exception("reading KV transfer completions failed")
            return
        for stamp in stamps:
            self.arrivals.deliver(stamp)

    def release_now(self, key: str) -> None:
        self.engine.submit_nowait(lambda e: e.release(key))

    def release_later(self, key: str, delay_s: float) -> None:
        """Free ``key``'s blocks after ``delay_s`` (a writer we cannot hear from may still write)."""

        def fire() -> None:
            self.quarantined.discard(handle)
            self.release_now(key)

        handle = asyncio.get_running_loop().call_later(delay_s, fire)
        self.quarantined.add(handle)
        if self.metrics is not None:
            self.metrics.deferred_releases.inc()

    def cancel_quarantines(self) -> None:
        for handle in self.quarantined:
            handle.cancel()
        self.quarantined.clear()

    def transfer_failed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.transfer_failed(reason)
