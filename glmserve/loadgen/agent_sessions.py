"""``glmserve bench agent``: synthetic coding-agent sessions over streamed chat completions.

A session holds one of ``concurrency`` slots from its first turn to its last, waits included, as
an agent holding a decode slot or a sticky worker does (guidellm #1082). A turn: send the
conversation (shared system prompt and tools, the repository context, every earlier turn), read
the streamed answer, then either run tool calls (the model's, or 1..``max_parallel_tools``
scripted ones), wait ``tool_wait_s`` (one wait for a parallel batch), and append their results;
or, with ``follow_up_fraction``, wait ``think_s`` and append a user message. A cancelled turn
(after N chunks or T seconds) keeps its partial answer and the user redirects. Waits are
exponential with the given means, seeded. Every request carries ``session_header: s<N>``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from glmserve.loadgen import agent_workload as work
from glmserve.loadgen.progress import LiveProgress
from glmserve.loadgen.request_record import RequestRecord
from glmserve.loadgen.stream_client import CancelRule, StreamClient, StreamOutput
from glmserve.loadgen.synthetic_text import seeded


@dataclass(frozen=True)
class AgentConfig:
    model: str
    sessions: int = 8
    turns: int = 6
    concurrency: int | None = None  # sessions at once; None: all
    session_rate: float | None = None  # new sessions per second; None: all at the start
    repos: int = 2
    system_tokens: int = 800
    tools: int = 8
    repo_tokens: int = 1600
    task_tokens: int = 60
    tool_result_tokens: int = 300
    max_output_tokens: int = 48
    max_parallel_tools: int = 3
    follow_up_fraction: float = 0.25
    think_s: float = 1.0
    tool_wait_s: float = 0.5
    cancel: CancelRule | None = None
    cancel_fraction: float = 0.1
    session_header: str = "x-session-id"
    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "repos", "tools", "max_output_tokens", "max_parallel_tools"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "repo_tokens", "task_tokens", "tool_result_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {self.concurrency}")
        if self.session_rate is not None and self.session_rate <= 0:
            raise ValueError(f"session_rate: must be > 0, got {self.session_rate}")
        for name in ("follow_up_fraction", "cancel_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {getattr(self, name)}")
        if self.think_s < 0 or self.tool_wait_s < 0:
            raise ValueError("think_s / tool_wait_s: must be >= 0")

    @classmethod
    def from_args(cls, args, cancel: CancelRule | None) -> AgentConfig:
        """From `glmserve bench agent`'s arguments (same names as the fields)."""
        names = ("sessions", "turns", "concurrency", "session_rate", "repos", "system_tokens", "tools",
                 "repo_tokens", "task_tokens", "tool_result_tokens", "max_parallel_tools", "follow_up_fraction",
                 "think_s", "tool_wait_s", "cancel_fraction", "session_header", "temperature", "seed")
        return cls(model=args.model or "", cancel=cancel, ignore_eos=not args.no_ignore_eos,
                   max_output_tokens=args.max_output_tokens or cls.max_output_tokens,
                   **{n: getattr(args, n) for n in names})


class AgentRun:
    def __init__(self, config: AgentConfig, client: StreamClient, progress: LiveProgress):
        self.config, self.client, self.progress = config, client, progress
        c = config
        self.tools = work.tool_schemas(c.tools, c.seed)
        self.system = work.system_prompt(c.system_tokens, c.seed)
        self.repos = [work.repo_context(r, c.repo_tokens, c.seed) for r in range(c.repos)]
        self.records: list[RequestRecord] = []

    def _wait(self, rng, mean: float) -> float:
        return rng.expovariate(1.0 / mean) if mean > 0 else 0.0

    async def _turn(self, sid: str, turn: int, messages: list[dict[str, Any]], cancel: CancelRule | None,
                    zero: float) -> tuple[RequestRecord, StreamOutput]:
        c = self.config
        body: dict[str, Any] = {"model": c.model, "messages": messages, "tools": self.tools,
                                "max_tokens": c.max_output_tokens, "temperature": c.temperature}
        if c.ignore_eos:
            body["ignore_eos"] = True
        record = RequestRecord(id=len(self.records), section="agent", endpoint="chat", session=sid, turn=turn,
                               scheduled_s=time.perf_counter() - zero, max_tokens=c.max_output_tokens)
        self.records.append(record)
        headers = {c.session_header: sid} if c.session_header else None
        out = await self.client.stream(record, body, headers, cancel, clock_zero=zero)
        self.progress.done(record)
        return record, out

    async def session(self, index: int, zero: float) -> None:
        c, sid = self.config, f"s{index}"
        rng = seeded("session", c.seed, index)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.repos[index % c.repos] + work.task_message(index, c.task_tokens, c.seed)},
        ]
        for turn in range(c.turns):
            cancel = c.cancel if c.cancel is not None and rng.random() < c.cancel_fraction else None
            record, out = await self._turn(sid, turn, messages, cancel, zero)
            if record.status == "error":
                return  # the session cannot go on without the answer
            if record.status == "cancelled" or rng.random() < c.follow_up_fraction:
                messages.append({"role": "assistant", "content": out.text})
                await asyncio.sleep(self._wait(rng, c.think_s))
                messages.append({"role": "user", "content": work.follow_up(index, turn, c.task_tokens, c.seed)})
                continue
            calls = [{"id": call["id"] or f"call_{sid}_{turn}_{i}", "type": "function",
                      "function": {"name": call["name"], "arguments": call["arguments"]}}
                     for i, call in sorted(out.tool_calls.items())]
            calls = calls or work.scripted_calls(rng, self.tools, rng.randint(1, c.max_parallel_tools), f"{sid}_{turn}")
            messages.append({"role": "assistant", "content": out.text, "tool_calls": calls})
            await asyncio.sleep(max(self._wait(rng, c.tool_wait_s) for _ in calls))  # parallel: the longest
            messages += [{"role": "tool", "tool_call_id": call["id"],
                          "content": work.tool_result(call, c.tool_result_tokens, c.seed)} for call in calls]

    async def run(self) -> list[RequestRecord]:
        c = self.config
        slots = asyncio.Semaphore(c.concurrency or c.sessions)
        self.progress.section("agent sessions", c.sessions * c.turns)
        zero = time.perf_counter()

        async def one(index: int) -> None:
            if c.session_rate:
                await asyncio.sleep(max(0.0, zero + index / c.session_rate - time.perf_counter()))
            async with slots:
                await self.session(index, zero)

        await asyncio.gather(*(one(i) for i in range(c.sessions)))
        return sorted(self.records, key=lambda r: r.start_s)
