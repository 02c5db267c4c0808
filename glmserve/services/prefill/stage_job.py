"""What one LayerSplit stage is asked (`StageJobSpec`), how its part of a job ended (`StageOutcome`),
the stage's place in its replica (`StageSettings`), and the next stage as the sender sees it
(`NextStage`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from glmserve.core.generation import SamplingParams
from glmserve.engine.handoff import PrefillOutput
from glmserve.model.layer_split import LayerSplitPlan

DEFAULT_STREAM_MIN_TOKENS = 512


@dataclass(frozen=True)
class StageJobSpec:
    request_id: str
    generation: int
    prompt_ids: Sequence[int]
    params: SamplingParams  # for the first token
    decode_target: bytes
    dest_block_ids: Sequence[int]
    checksum: bool = False
    cache_salt: str = ""

    @property
    def key(self) -> str:
        return f"{self.request_id}@{self.generation}"


@dataclass(frozen=True)
class StageOutcome:
    """How the job ended on one stage: ``ok`` (all its writes done), else why, and whether no more
    bytes of it can land in the decode worker's blocks. The last stage's ``handoff`` when ok."""

    ok: bool
    error: str = ""
    drained: bool = True
    handoff: PrefillOutput | None = None  # num_cached_tokens: the replica's, set by the head
    computed_at: float = 0.0  # time.monotonic() when its last chunk was computed
    writes: tuple[tuple[float, float, int], ...] = ()  # its KV writes: (started, finished, bytes)


@dataclass(frozen=True)
class StageSettings:
    """This stage's place in its replica, and how it pipelines."""

    plan: LayerSplitPlan
    index: int
    chunk_tokens: int = 2048
    stream_min_tokens: int = DEFAULT_STREAM_MIN_TOKENS  # shorter prompts: one KV write per stage
    slots: int = 4  # receive slots (and as many send rows) for chunk outputs
    job_timeout_s: float = 120.0  # a job nobody finished or aborted in this long is aborted

    def __post_init__(self) -> None:
        if not 0 <= self.index < len(self.plan.stages):
            raise ValueError(f"stage: {self.index} is not a stage of the {len(self.plan.stages)}-stage plan")
        if self.chunk_tokens < 1 or self.slots < 1 or self.stream_min_tokens < 0 or self.job_timeout_s <= 0:
            raise ValueError("chunk_tokens: chunk_tokens, slots, stream_min_tokens and job_timeout_s must be positive")

    @property
    def num_stages(self) -> int:
        return len(self.plan.stages)

    @property
    def layers(self) -> range:
        return self.plan.ranges[self.index]

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def sends_topk(self) -> bool:
        """The next stage starts on a shared layer: send the top-k with the hidden states."""
        return not self.is_last and self.plan.carries_topk(self.index + 1)


class NextStage(Protocol):
    """What a stage needs of the stage after it (`glmserve.services.prefill.stage_client`)."""

    async def activation_target(self) -> bytes: ...

    async def slot(self, request_id: str, generation: int, chunk: int) -> int: ...

    async def chunk(self, request_id: str, generation: int, chunk: int, slot: int, start: int, num_tokens: int,
                    topk_width: int, stamp: bytes) -> None: ...
