"""FlowContext: what every `DecodeFlow` of one decode worker shares, and the block-freeing helpers
(now, or after a quarantine while a writer we cannot hear from may still write)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from glmserve.core.generation import SamplingParams
from glmserve.kv.transfer import TransferStamp
from glmserve.services.decode.arrivals import TransferArrivals
from glmserve.services.decode.prefill_client import PrefillPort
from glmserve.services.engine_thread import EngineThread
from glmserve.services.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    from glmserve.services.decode.worker import DecodeSettings

log = logging.getLogger(__name__)


@dataclass
class FlowContext:
    """What every flow of one worker shares (set up once the engine is loaded)."""

    engine: EngineThread
    prefill: PrefillPort
    arrivals: TransferArrivals
    settings: DecodeSettings
    metrics: WorkerMetrics | None
    target: bytes  # this worker's transfer target_info()
    transfer_kind: str
    block_size: int
    vocab_size: int
    max_positions: int
    completions: Callable[[], list[TransferStamp]]  # the receiving backend's
    quarantined: set[asyncio.TimerHandle] = field(default_factory=set)

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids: a prompt needs at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt_ids) + params.max_tokens > self.max_positions:
            raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens plus max_tokens {params.max_tokens} "
                             f"exceed the model's {self.max_positions} positions")

    def poll_completions(self) -> None:
        """Hand every completion that arrived to the flow expecting it (stale ones are dropped).

        Polled only by flows whose Prefill answered (the writer saw its write done, so the
        completion is there or about to be): no polling while prefills compute."""
        try:
            stamps = self.completions()
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
