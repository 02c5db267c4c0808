"""What a prefill worker is asked (`PrefillJob`), what it answers (`PrefillResult`,
`AbortOutcome`; its Health is `services.worker_health.WorkerHealth`), and how a job ends without a result (`PrefillError`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from glmserve.core.errors import GlmServeError
from glmserve.core.generation import SamplingParams
from glmserve.engine.handoff import PrefillOutput
from glmserve.kv.transfer import TransferStamp


class PrefillError(GlmServeError):
    """A prefill ended without a result; ``drained``: no more bytes can land in the destination."""

    def __init__(self, message: str, drained: bool) -> None:
        super().__init__(f"{message} (destination {'drained' if drained else 'NOT drained'})")
        self.drained = drained


class PrefillAborted(PrefillError):
    """Abort arrived for this (request id, generation), or the generation was already aborted."""


class PrefillFailed(PrefillError):
    """The decode worker could not be reached, the transfer failed, or the engine failed."""


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    generation: int
    prompt_ids: Sequence[int]
    params: SamplingParams  # for the first token
    decode_target: bytes  # the receiver's KVTransferBackend.target_info()
    dest_block_ids: Sequence[int]  # the receiver's blocks, in order, covering the prompt
    transfer_kind: str
    checksum: bool = False
    cache_salt: str = ""  # tenant prefix-cache salt; empty: none


@dataclass(frozen=True)
class PrefillResult:
    output: PrefillOutput  # the first token and the MTP seed
    stamp: TransferStamp  # of the completed transfer
    num_stages: int = 1  # LayerSplit: stages that each wrote their slice (stamps with a StampPart)


def check_job(spec: PrefillJob, transfer_kind: str, block_size: int) -> None:
    """Raises ``ValueError`` naming the field when a job cannot run here."""
    if not spec.prompt_ids:
        raise ValueError("prompt_ids: a prompt needs at least one token")
    if spec.transfer_kind != transfer_kind:
        raise ValueError(f"transfer_kind: this worker transfers with {transfer_kind!r}, "
                         f"the decode worker asked for {spec.transfer_kind!r}")
    need = -(-len(spec.prompt_ids) // block_size)
    if len(spec.dest_block_ids) != need:
        raise ValueError(f"dest_block_ids: {len(spec.prompt_ids)} prompt tokens need {need} blocks "
                         f"of {block_size}, got {len(spec.dest_block_ids)}")


@dataclass(frozen=True)
class AbortOutcome:
    found: bool  # the job was still running
    drained: bool


async def drain_jobs(running: Callable[[], int], timeout_s: float, settle_s: float = 1.5) -> int:
    """A draining prefill worker's wait (its Health already says not ready): jobs still come in for
    ``settle_s`` (a decode worker may have reserved blocks for a prompt routed here just before) and
    are served. Returns, once none ran after ``settle_s`` or at ``timeout_s``, how many still run."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while loop.time() - started < timeout_s:
        if not running() and loop.time() - started >= min(settle_s, timeout_s):
            break
        await asyncio.sleep(0.05)
    return running()
