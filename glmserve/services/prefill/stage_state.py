"""What a LayerSplit stage tracks about one job while it runs (`StageJobState`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from glmserve.engine.handoff import PrefillOutput
from glmserve.engine.stage_engine import ChunkOutput
from glmserve.kv.transfer import TransferHandle
from glmserve.services.prefill.stage_job import StageJobSpec, StageOutcome


@dataclass(eq=False)
class StageJobState:
    spec: StageJobSpec
    peer: str  # the decode worker's KV buffer, through this stage's window
    outcome: asyncio.Future[StageOutcome]
    writes: dict[int, tuple[int, range]] = field(default_factory=dict)  # chunk -> (write index, job blocks)
    num_chunks: int = 0
    computed: int = 0
    sent: int = 0
    handles: list[TransferHandle] = field(default_factory=list)  # every write: KV and chunk outputs
    kv_handles: list[TransferHandle] = field(default_factory=list)  # its KV writes to the decode worker
    computed_at: float = 0.0
    handoff: PrefillOutput | None = None
    stopped: str | None = None  # why the job stopped early (abort, failure): queued chunks are skipped
    ending: bool = False  # no write starts any more
    loading: bool = False  # a host-tier load-back into its blocks is running
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # admitted, or ended: chunks may come
    recv_slots: set[int] = field(default_factory=set)  # receive slots granted, not yet consumed
    outputs: dict[int, asyncio.Future[tuple[int, ChunkOutput]]] = field(default_factory=dict)  # for the sender
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    timer: asyncio.TimerHandle | None = None


def output_future(job: StageJobState, chunk: int) -> asyncio.Future[tuple[int, ChunkOutput]]:
    """Chunk ``chunk``'s outputs for the sender, in chunk order whatever order they are set in."""
    if chunk not in job.outputs:
        job.outputs[chunk] = asyncio.get_running_loop().create_future()
    return job.outputs[chunk]

