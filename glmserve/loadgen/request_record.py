"""One request's measurements, as written one JSON object a line to ``requests.jsonl``.

Times are seconds; ``start_s`` and ``scheduled_s`` count from the start of the run. ``status`` is
``ok`` (the stream ended with ``[DONE]``), ``cancelled`` (the harness left on purpose, after N
chunks or T seconds: not an error) or ``error`` (``error_kind`` says which: ``http_<status>``,
``stream_error``, ``incomplete_stream``, ``connect``, ``connection_lost``, ``timeout``,
``bad_chunk``: not JSON, or not the OpenAI shape). Token counts come from the server's ``usage``; ``chunk_tokens`` (tokens per
streamed chunk) only when the server said (logprobs) or ``None``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("ok", "cancelled", "error")


@dataclass
class RequestRecord:
    id: int
    section: str = ""
    endpoint: str = "completions"  # completions | chat
    session: str | None = None
    turn: int | None = None
    scheduled_s: float | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0  # streamed chunks that carried output
    chunk_tokens: list[int] | None = None
    prompt_tokens_sent: int | None = None  # what the harness sent, when it knows (token prompts)
    prompt_tokens: int | None = None  # usage
    output_tokens: int | None = None  # usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    max_tokens: int | None = None
    finish_reason: str | None = None
    status: str = "ok"
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None

    @property
    def end_s(self) -> float:
        return self.start_s + (self.e2e_s or 0.0)

    @property
    def prompt_length(self) -> int | None:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_tokens_sent

    def finish_timing(self) -> None:
        """TPOT from E2E, TTFT and usage's output tokens: (E2E - TTFT) / (output tokens - 1)."""
        if self.status == "ok" and self.ttft_s is not None and self.e2e_s is not None \
                and self.output_tokens is not None and self.output_tokens > 1:
            self.tpot_s = (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_jsonl(records: list[RequestRecord], path: Path) -> None:
    with Path(path).open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.to_dict()) + "\n")


def read_jsonl(path: Path) -> list[RequestRecord]:
    with Path(path).open(encoding="utf-8") as f:
        return [RequestRecord(**json.loads(line)) for line in f if line.strip()]
