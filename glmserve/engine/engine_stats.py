"""EngineStats: counters the engine keeps, read by metrics exporters and benchmarks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    preemptions: int = 0
    aborts: int = 0
    # Tokens a decoding request gained per verify step (1 + accepted drafts) -> number of such steps.
    acceptance_lengths: Counter = field(default_factory=Counter)
    # Draft length k of each verified drafting step -> number of such steps.
    draft_lengths: Counter = field(default_factory=Counter)

    @property
    def mean_acceptance_length(self) -> float:
        steps = sum(self.acceptance_lengths.values())
        return sum(k * v for k, v in self.acceptance_lengths.items()) / steps if steps else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is right now (``Engine.load()``; read on the engine's thread)."""

    running: int  # requests in the batch
    waiting: int  # requests queued for a slot or blocks
    held: int  # prefill-only requests finished, blocks kept for their transfer
    reserved: int  # reservations waiting for KV another worker writes
    free_blocks: int  # free or only prefix-cached
    used_blocks: int  # with an owner
    total_blocks: int
    evictions: int = 0  # cached blocks evicted so far (a counter)


@dataclass(frozen=True)
class EngineLimits:
    """What requests must fit (``Engine.limits()``)."""

    vocab_size: int
    max_positions: int  # prompt + max_tokens at most
    block_size: int
    hidden_size: int  # of the MTP seed a prefill hands over
