"""Request: one generation request as the engine tracks it, from arrival to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from glmserve.core.generation import SamplingParams
from glmserve.core.stop_checker import StopChecker
from glmserve.text.output_text import OutputText


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Token bookkeeping, in positions of the sequence prompt + output.

    - `token_ids`: prompt + output as one list, grown in place by `append_output` (never rebuilt:
      a step's bookkeeping costs the same for a 100-token and a 100K-token prompt).

    - `num_computed`: tokens whose main-model KV is in the request's blocks (positions 0..n-1).
    - In decode, the last token of `token_ids` is pending: sampled, not yet run through the model.
    - `mtp_synced`: positions whose MTP-layer KV was computed from the main model's hidden states.
    - `mtp_pending`: main-model hidden rows of positions mtp_synced.. not yet run through the MTP layer
      (steps that drafted nothing); they are caught up when drafting resumes.
    - `drafts` / `draft_probs`: MTP proposals for the tokens after the pending one, verified next step.
    - `logits`: what processes its logits before sampling (grammar, penalties, bias; `LogitsProcessor`).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False, repr=False)  # prompt + output (see the class docstring)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the leading full blocks, in order
    num_computed: int = 0
    num_cached_prompt: int = 0  # prompt tokens found in the prefix cache at admission
    mtp_synced: int = 0
    mtp_pending: list[torch.Tensor] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    first_token_time: float | None = None
    scheduled_time: float | None = None  # first admitted to run (queue time ends)
    num_preemptions: int = 0
    cache_salt: str | None = None  # tenant prefix-cache salt: enters the hash of block 0
    hold_blocks: bool = False  # prefill-only: keep the blocks after finishing, until released
    last_hidden: torch.Tensor | None = None  # normed hidden state of the last prompt token (MTP seed)
    stop_checker: StopChecker | None = None
    output_text: OutputText | None = None  # set when the engine has a tokenizer
    logits: Any = None  # a logits_processor.RequestLogits, or None when nothing applies

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids: a request needs at least one prompt token")
        self.token_ids = list(self.prompt_ids) + self.output_ids
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def append_output(self, token_ids: list[int]) -> None:
        self.output_ids.extend(token_ids)
        self.token_ids.extend(token_ids)

    @property
    def generated_ids(self) -> list[int]:
        """The request's output, including what an earlier attempt generated (the prompt's last
        ``params.num_resumed`` ids): what penalties and the grammar count."""
        return self.token_ids[len(self.prompt_ids) - self.params.num_resumed:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def in_prefill(self) -> bool:
        """Tokens other than the pending one still need the main model."""
        return self.num_computed < self.num_tokens - (1 if self.output_ids else 0)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
