"""EngineConfig: an engine's sizes and switches (frozen; ``ValueError`` naming the field)."""

from __future__ import annotations

from dataclasses import dataclass

MTP_HELP = "MTP speculative decoding: 'auto' (adaptive drafts), 'off', or a fixed number of drafts"


def mtp_option(value: str) -> str | int:
    """EngineConfig.mtp from its command-line spelling: 'auto', 'off' or a number of drafts >= 0."""
    if value in ("auto", "off"):
        return value
    if value.isdigit():
        return int(value)
    raise ValueError(f"mtp: {value!r} is not 'auto', 'off' or a number of drafts >= 0")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 64
    kv_cache_bytes: int = 256 * 2**20
    max_num_seqs: int = 64
    max_step_tokens: int = 2048
    max_shared_prompt_tokens: int = 512  # see Scheduler: prompts share a step up to this many prompt tokens
    mtp: str | int = "auto"  # "auto" (adaptive k), "off", or a fixed number of drafts
    max_drafts: int = 3
    prefix_caching: bool = True
    host_staging_blocks: int = 0  # extra cache rows for demoting evicted blocks to the host tier
    check_integrity: bool = False  # check the block pool after every step (tests; O(num_blocks))

    def __post_init__(self) -> None:
        if self.mtp not in ("auto", "off") and not (isinstance(self.mtp, int) and self.mtp >= 0):
            raise ValueError(f"mtp: {self.mtp!r} is not 'auto', 'off' or a number of drafts >= 0")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes: must be > 0")
        if self.host_staging_blocks < 0:
            raise ValueError(f"host_staging_blocks: must be >= 0, got {self.host_staging_blocks}")
