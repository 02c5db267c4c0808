"""HostTierLink: a worker's connection to the kvstore's host tier (write-through, demotion, load-back).

Shared by the prefill and decode workers. The engine side (which blocks, who owns them) is the
engine's `HostOffload`; this moves the bytes with the worker's own transfer backend and talks to
the kvstore over gRPC (``AsyncKVStoreClient``). Nothing here blocks the event loop.

Writes (write-through and demotion): ``host_begin_write`` leases host rows for the hashes the host
lacks, ``transfer.write`` copies our rows there (stamp ``write_stamp(lease)``), ``host_end_write``
commits them once done (or gives them back once drained; a write that could not be confirmed
drained leaves its lease to the kvstore's timeout). The engine gets its rows back when the write
is final.

A LayerSplit stage's rows are its slice of the host tier's whole-model blocks (``start`` with the
slice): it writes only that slice of each block, as its part (``part``: the host stores a block
once every stage's part landed), and loads back only that slice.

Load-back (prefill): ``load`` finds the prompt's blocks that are on the host but not on device,
pins the device hits and allocates destination blocks (`HostOffload.begin_load`), and asks the
kvstore to write them (``host_load``; stamp (engine key, generation), checked on arrival). On
success the caller hashes them and adds the request in one engine command (`Loaded.apply`). A
load that fails, or is cancelled (``cancel``), frees its blocks once the kvstore says its write is
drained, else after ``load_timeout_s`` (the agreed timeout). The host tier is an optimisation:
every failure is logged and counted, and the request is computed without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from glmserve.core.block_hash import block_hashes, reusable_blocks
from glmserve.engine.host_offload import HostWrite
from glmserve.kv.host_pool import write_stamp
from glmserve.kv.transfer import BlockWindow, KVTransferBackend, TransferError, TransferStamp
from glmserve.kv.transfer.timeouts import AGREED
from glmserve.services.engine_host import EngineHost
from glmserve.services.host_metrics import HostTierMetrics
from glmserve.services.kvstore.client import AsyncKVStoreClient, HostAttachment, KVStoreError
from glmserve.services.stamp_waiter import StampWaiter

if TYPE_CHECKING:
    import torch

    from glmserve.engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostTierSettings:
    """How a worker uses the kvstore's host tier."""

    address: str  # host:port of the kvstore
    worker_id: str
    write_through: bool = True  # write a finished request's full blocks to the host
    load_timeout_s: float = AGREED.release_s  # a load's deadline; undrained destinations wait this long

    def __post_init__(self) -> None:
        if not self.address or not self.worker_id:
            raise ValueError("address: kvstore host:port and worker_id must not be empty")
        if self.load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s: must be > 0, got {self.load_timeout_s}")


@dataclass(frozen=True)
class Loaded:
    """Blocks a load put on device, still owned by the load until ``apply`` runs."""

    key: str
    device_blocks: int  # leading prompt blocks that were already on device
    host_blocks: int  # the blocks after them, loaded from the host

    def apply(self, engine: Engine, then: object) -> object:
        """On the engine thread: hash the loaded blocks, run ``then()`` (add the request, which
        acquires them), then drop the load's ownership whatever ``then`` did."""
        assert engine.host_tier is not None
        engine.host_tier.commit_load(self.key, self.host_blocks)
        try:
            return then()  # type: ignore[operator]
        finally:
            engine.host_tier.end_load(self.key)


class HostTierLink:
    def __init__(self, settings: HostTierSettings, transfer: KVTransferBackend, engine: EngineHost,
                 metrics: HostTierMetrics | None, *, rpc_timeout_s: float = 2.0,
                 part: tuple[int, int] | None = None) -> None:
        """``part``: (stage, stages) of a LayerSplit stage (its writes are that part of each block)."""
        self.address, self.worker_id = settings.address, settings.worker_id
        self._transfer, self._engine, self.metrics = transfer, engine, metrics
        self._write_through, self._load_timeout_s = settings.write_through, settings.load_timeout_s
        self._rpc_timeout_s = rpc_timeout_s
        self._client: AsyncKVStoreClient | None = None
        self._peer: str | None = None
        self._root: bytes | None = None
        self._block_size = self._block_bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._stamps = StampWaiter(transfer.completions)
        self._part, self._row_offset, self._row_bytes = part, 0, 0
        self._instance: str | None = None  # the kvstore instance attached to
        self._refused = False  # the kvstore refused to attach us (no host tier, another block size)
        self._watcher: asyncio.Task[None] | None = None
        self.ready = False

    # -- setup --------------------------------------------------------------------------------------

    async def start(self, buffer: torch.Tensor, row_offset: int = 0, row_bytes: int = 0) -> bool:
        """Attach to the host tier (after ``transfer.register(buffer)``) and keep watching it; False,
        logged, if it cannot attach now (the watcher attaches once the kvstore answers).
        ``row_offset``/``row_bytes``: our rows are that slice of whole-model blocks (a stage)."""
        self._client = AsyncKVStoreClient(self.address, timeout_s=self._rpc_timeout_s)
        self._block_bytes = buffer[0].numel() * buffer.element_size()
        self._row_offset, self._row_bytes = row_offset, row_bytes
        attached = await self._connect(wait_s=60.0)
        self._watcher = asyncio.create_task(self._watch())
        return attached

    async def _connect(self, wait_s: float = 0.0) -> bool:
        """HostAttach (retried for ``wait_s`` while the kvstore is unavailable: services start side
        by side), connect the backend to the tier's target and, the first time, turn on the
        engine's host side; ``ready`` when all of it worked. A kvstore that refuses (it has no host
        tier, or another block size) is not asked again until it restarted."""
        self.ready = False
        window = BlockWindow(0, self._row_offset, self._block_bytes) if self._row_bytes else None
        try:
            attachment = await self._attach(wait_s)
            self._peer = await asyncio.to_thread(self._transfer.connect, attachment.target_info, window)
        except (KVStoreError, TransferError, ValueError, OSError) as e:
            log.warning("host tier at %s not used for now: %s", self.address, e)
            self._refused = not (isinstance(e, KVStoreError) and e.unavailable)
            return False
        if not self._block_size:  # the engine's host side is turned on once
            def attach(e: Engine) -> tuple[bytes | None, int]:
                dropped = self.metrics.demotions_dropped.inc if self.metrics is not None else None
                e.attach_host_tier(self._write_through, self._notify, dropped)  # Counter.inc is thread-safe
                return e.cache_root or None, e.limits().block_size

            self._root, self._block_size = await self._engine.submit(attach)
        self._instance, self._refused, self.ready = attachment.instance_id, False, True
        log.info("host tier at %s: %d blocks of %d B, write-through %s", self.address, attachment.num_blocks,
                 self._block_bytes, "on" if self._write_through else "off")
        return True

    async def _watch(self, interval_s: float = 1.0) -> None:
        """Attach again when the kvstore restarted (a new instance: an empty tier, a new transfer
        target) or came back; not ready while it does not answer."""
        assert self._client is not None
        seen: str | None = None  # the instance last answering Health
        while True:
            await asyncio.sleep(interval_s)
            try:
                instance = (await self._client.health()).instance_id
            except KVStoreError:
                if self.ready:
                    log.warning("host tier at %s unreachable; not used until it is back", self.address)
                self.ready = False
                continue
            restarted, seen = seen is not None and instance != seen, instance
            if restarted:
                log.info("kvstore at %s restarted: attaching to its host tier again", self.address)
            if (self.ready and instance == self._instance) or (self._refused and not restarted):
                continue
            await self._connect()

    async def _attach(self, wait_s: float) -> HostAttachment:
        """HostAttach, retried while the kvstore is unavailable, for up to ``wait_s``."""
        assert self._client is not None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self._client.host_attach(self.worker_id, self._transfer.kind, self._block_bytes,
                                                      self._transfer.target_info(), self._row_offset,
                                                      self._row_bytes)
            except KVStoreError as e:
                if not e.unavailable or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10.0)
        if self._client is not None:
            await self._client.close()

    # -- writes ---------------------------------------------------------------------------------------

    def _notify(self, write: HostWrite) -> None:
        """Engine thread: a write to start (see `HostOffload`)."""
        self._engine.post(self._spawn, write)

    def _spawn(self, write: HostWrite) -> None:
        task = asyncio.create_task(self._write(write))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, write: HostWrite) -> None:
        stored: list[bytes] = []
        try:
            stored = await self._copy(write)
        except (KVStoreError, TransferError, ValueError) as e:
            log.warning("host-tier %s of %d blocks failed: %s", write.kind, len(write.rows), e)
            if self.metrics is not None:
                self.metrics.failures.labels(op=write.kind).inc()
        finally:  # the write is final here: the rows go back to the engine
            self._engine.submit_nowait(lambda e: e.host_tier.write_done(write, stored))

    async def _copy(self, write: HostWrite) -> list[bytes]:
        assert self._client is not None
        if not self.ready or self._peer is None:
            return []  # detached (kvstore down or restarting): the write is skipped
        grant = await self._client.host_begin_write(self.worker_id, write.hashes, self._part)
        if not grant.lease_id:
            return []
        row_of = dict(zip(write.hashes, write.rows, strict=True))
        handle = self._transfer.write(self._peer, write_stamp(grant.lease_id),
                                     [row_of[h] for h in grant.hashes], grant.block_ids)
        await asyncio.to_thread(handle.wait)
        if handle.state != "done":
            if handle.drained:
                await self._client.host_end_write(grant.lease_id, committed=False)
            raise TransferError(f"write to the host tier failed: {handle.error}")
        await self._client.host_end_write(grant.lease_id, committed=True)
        if self.metrics is not None:
            self.metrics.writes.labels(kind=write.kind).inc(len(grant.hashes))
            self.metrics.write_bytes.labels(kind=write.kind).inc(handle.num_bytes)
            if write.kind == "demotion":
                self.metrics.demotions.inc(len(grant.hashes))
        return grant.hashes

    # -- load-back ----------------------------------------------------------------------------------

    async def load(self, key: str, generation: int, prompt_ids: Sequence[int],
                   salt: str | None = None) -> Loaded | None:
        """Bring the prompt's host-only leading blocks onto device (see the module docstring);
        `salt` is the tenant's cache salt. None: nothing loaded and nothing held."""
        if not self.ready:
            return None
        assert self._client is not None and self._root is not None
        started = time.perf_counter()
        n = reusable_blocks(len(prompt_ids), self._block_size)
        if n == 0:
            return None
        hashes = await asyncio.to_thread(block_hashes, self._root, list(prompt_ids[: n * self._block_size]),
                                         self._block_size, salt=salt)
        first = await self._engine.submit(lambda e: e.host_tier.device_hits(hashes))
        try:
            on_host = await self._client.host_lookup(hashes[first:]) if first < n else 0
        except KVStoreError as e:
            self._failed("lookup", e)
            return None
        if on_host == 0:
            return None
        wanted = hashes[: first + on_host]
        device, dest = await self._engine.submit(lambda e: e.host_tier.begin_load(key, wanted))
        loaded = await self._load_blocks(key, generation, wanted[device: device + len(dest)], dest)
        if loaded == 0:
            return Loaded(key, device, 0)  # still holds the device hits: apply() or cancel() ends it
        if self.metrics is not None:
            self.metrics.loadbacks.inc()
            self.metrics.loadback_blocks.inc(loaded)
            self.metrics.loadback_bytes.inc(loaded * self._block_bytes)
            self.metrics.loadback_seconds.observe(time.perf_counter() - started)
        return Loaded(key, device, loaded)

    async def _load_blocks(self, key: str, generation: int, hashes: list[bytes], dest: list[int]) -> int:
        """Blocks written into ``dest``; 0 when none (then the destination blocks are already given
        back, or quarantined until they are surely drained)."""
        if not dest:
            return 0
        with self._transfer.expecting_writes():
            return await self._load_written(key, generation, hashes, dest)

    async def _load_written(self, key: str, generation: int, hashes: list[bytes], dest: list[int]) -> int:
        assert self._client is not None
        try:
            outcome = await self._client.host_load(self.worker_id, key, generation, hashes, dest,
                                                   timeout_s=self._load_timeout_s)
        except KVStoreError as e:  # the kvstore may still be writing: wait out the agreed timeout
            self._failed("load", e)
            self._quarantine(key, self._load_timeout_s)
            raise LoadAborted(f"host load failed: {e}") from e
        if outcome.blocks_loaded == 0:
            self._release_dest_later(key, outcome.drained)
            raise LoadAborted(f"host load ended without blocks: {outcome.error or 'none stored'}")
        try:
            await self._await_stamp(TransferStamp(key, generation))
        except TimeoutError as e:
            self._failed("load", e)
            self._quarantine(key, 0.0)
            raise LoadAborted(f"host load not confirmed: {e}") from e
        return outcome.blocks_loaded

    async def _await_stamp(self, expected: TransferStamp, timeout_s: float = 5.0) -> None:
        """The load's completion (DESIGN invariant 3: check the stamp before using the blocks)."""
        await self._stamps.wait(expected, timeout_s)

    async def cancel(self, key: str, generation: int) -> None:
        """Stop a running load (the awaiting ``load`` then raises `LoadAborted`)."""
        if self._client is None:
            return
        try:
            await self._client.host_cancel_load(key, generation)
        except KVStoreError as e:
            log.warning("cancel of host load %s: %s", key, e)

    def _release_dest_later(self, key: str, drained: bool) -> None:
        self._quarantine(key, 0.0 if drained else self._load_timeout_s)

    def _quarantine(self, key: str, delay_s: float) -> None:
        """Give the load's blocks back after ``delay_s`` (0: now)."""

        def give_back() -> None:
            self._engine.submit_nowait(lambda e: e.host_tier.cancel_load(key))

        if delay_s <= 0:
            give_back()
        else:
            asyncio.get_running_loop().call_later(delay_s, give_back)

    def release(self, key: str) -> None:
        """Give back what a finished load still holds (the request was not added after all)."""
        self._engine.submit_nowait(lambda e: e.host_tier.cancel_load(key))

    def _failed(self, op: str, error: Exception) -> None:
        log.warning("host tier %s: %s", op, error)
        if self.metrics is not None:
            self.metrics.failures.labels(op=op).inc()


class LoadAborted(Exception):
    """A load-back ended without blocks; what it held is (or will be) given back."""
