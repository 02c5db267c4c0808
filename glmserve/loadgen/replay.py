"""``glmserve bench replay``: a Mooncake-format trace sent to an OpenAI-compatible server.

Each trace entry becomes one streamed request whose prompt is its hash ids' blocks
(`prompt_blocks`), ``tokens_per_block`` tokens a block, capped at ``max_input_tokens``, asking for
its ``output_length`` tokens (capped at ``max_output_tokens``; ``ignore_eos`` so that the count is
the trace's). One section per ``--rate`` value; every section replays the same entries under its
own block salt, so no section is served from an earlier one's cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmserve.loadgen.progress import LiveProgress
from glmserve.loadgen.prompt_blocks import TextBlocks, TokenBlocks
from glmserve.loadgen.request_record import RequestRecord
from glmserve.loadgen.schedule import ARRIVALS, parse_rates, rate_label, send_offsets
from glmserve.loadgen.stream_client import CancelRule, StreamClient
from glmserve.loadgen.synthetic_text import seeded
from glmserve.loadgen.trace import TRACE_BLOCK_TOKENS, TraceEntry, load_trace, scaled_input_length

PROMPT_FORMATS = ("tokens", "text")
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class ReplayConfig:
    trace: Path
    model: str
    max_requests: int | None = None
    time_scale: float = 1.0
    tokens_per_block: int = TRACE_BLOCK_TOKENS
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    concurrency: int | None = None  # None: no limit
    rates: tuple[float | None, ...] = (None,)  # None: the trace's timestamps
    arrival: str = "poisson"
    endpoint: str = "completions"
    prompt_format: str = "tokens"
    token_ids: tuple[int, ...] = tuple(range(1000, 8000))  # drawn from for token blocks
    ignore_eos: bool = True
    temperature: float = 0.0
    chunk_logprobs: bool = False
    cancel: CancelRule | None = None
    cancel_fraction: float = 1.0
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_input_tokens", "max_output_tokens", "concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block: must be >= 1, got {self.tokens_per_block}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format: must be one of {', '.join(PROMPT_FORMATS)}, got {self.prompt_format!r}")
        if self.endpoint == "chat" and self.prompt_format == "tokens":
            raise ValueError("prompt_format: chat requests take text; use --prompt-format text (or --endpoint completions)")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival: must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise ValueError(f"cancel_fraction: must be in [0, 1], got {self.cancel_fraction}")
        if self.time_scale < 0:
            raise ValueError(f"time_scale: must be >= 0, got {self.time_scale}")

    @classmethod
    def from_args(cls, args, cancel: CancelRule | None, token_ids: Sequence[int]) -> ReplayConfig:
        """From `glmserve bench replay`'s arguments (same names as the fields)."""
        names = ("trace", "max_requests", "time_scale", "tokens_per_block", "max_input_tokens", "max_output_tokens",
                 "concurrency", "arrival", "endpoint", "prompt_format", "temperature", "chunk_logprobs",
                 "cancel_fraction", "seed")
        return cls(model=args.model or "", rates=parse_rates(args.rate), token_ids=tuple(token_ids), cancel=cancel,
                   ignore_eos=not args.no_ignore_eos, **{n: getattr(args, n) for n in names})


class ReplayRun:
    def __init__(self, config: ReplayConfig, client: StreamClient, progress: LiveProgress, tokenizer=None,
                 entries: list[TraceEntry] | None = None):
        self.config, self.client, self.progress, self.tokenizer = config, client, progress, tokenizer
        self.entries = entries if entries is not None else load_trace(config.trace, config.max_requests)

    def _blocks(self, salt: int) -> TokenBlocks | TextBlocks:
        c = self.config
        if c.prompt_format == "tokens":
            return TokenBlocks(c.tokens_per_block, c.token_ids, salt)
        return TextBlocks(c.tokens_per_block, salt, self.tokenizer)

    def _body(self, entry: TraceEntry, blocks: TokenBlocks | TextBlocks) -> tuple[dict[str, Any], int | None]:
        c = self.config
        length = scaled_input_length(entry, c.tokens_per_block)
        if c.max_input_tokens is not None:
            length = min(length, c.max_input_tokens)
        out = min(entry.output_length, c.max_output_tokens or entry.output_length)
        body: dict[str, Any] = {"model": c.model, "max_tokens": out, "temperature": c.temperature, **c.extra_body}
        if c.ignore_eos:
            body["ignore_eos"] = True
        prompt = blocks.prompt(entry.hash_ids, length)
        if c.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            if c.chunk_logprobs:
                body["logprobs"] = True
        else:
            body["prompt"] = prompt
            if c.chunk_logprobs:
                body["logprobs"] = 0
        return body, (len(prompt) if isinstance(prompt, list) else None)

    async def run_section(self, index: int, rate: float | None, run_zero: float) -> list[RequestRecord]:
        c, label = self.config, rate_label(rate)
        offsets = send_offsets([e.timestamp_s for e in self.entries], rate, c.time_scale, c.arrival, c.seed)
        pick = seeded("cancel", c.seed, index)
        cancels = [c.cancel if c.cancel and pick.random() < c.cancel_fraction else None for _ in self.entries]
        blocks = self._blocks(salt=c.seed * 1000 + index)
        slots = asyncio.Semaphore(c.concurrency) if c.concurrency else None
        self.progress.section(f"replay {label}", len(self.entries))
        zero = time.perf_counter()

        async def one(i: int, entry: TraceEntry) -> RequestRecord:
            await asyncio.sleep(max(0.0, zero + offsets[i] - time.perf_counter()))
            async with slots if slots is not None else contextlib.nullcontext():
                body, sent = self._body(entry, blocks)
                record = RequestRecord(id=i, section=label, endpoint=c.endpoint, prompt_tokens_sent=sent,
                                       scheduled_s=zero - run_zero + offsets[i], max_tokens=body["max_tokens"])
                await self.client.stream(record, body, cancel=cancels[i], clock_zero=run_zero)
            self.progress.done(record)
            return record

        return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(self.entries))))

    async def run(self, pause_s: float = 1.0) -> list[tuple[str, float | None, list[RequestRecord]]]:
        """One (label, rate, records) per rate, in order, ``pause_s`` apart."""
        run_zero = time.perf_counter()
        sections = []
        for index, rate in enumerate(self.config.rates):
            if index:
                await asyncio.sleep(pause_s)
            sections.append((rate_label(rate), rate, await self.run_section(index, rate, run_zero)))
        return sections


def token_id_pool(tokenizer, default: Sequence[int]) -> tuple[int, ...]:
    """Ids to draw token blocks from: a given tokenizer's ordinary (non-special) ids, else ``default``."""
    if tokenizer is None:
        return tuple(default)
    return tuple(i for i in range(min(tokenizer.vocab_size, 1 << 20)) if i not in tokenizer.special_ids)
