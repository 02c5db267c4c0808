"""Variants of a hash-id request trace, so that a routing policy is judged on more than one shape.

Each variant rewrites the trace's rows (arrival ms, input length, 512-token hash ids) and keeps the
rest of the replay as it is. Fresh ids are numbered above every id of the trace, so they never
collide with a shared block.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

BLOCK = 512  # tokens per trace hash id


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    hash_ids: tuple[int, ...]


def read_rows(path: Path, n: int) -> list[TraceRow]:
    """The first `n` rows of a Mooncake-format trace file."""
    rows = []
    with path.open() as f:
        for line in f:
            if len(rows) >= n:
                break
            row = json.loads(line)
            rows.append(TraceRow(row["timestamp"], row["input_length"], tuple(row["hash_ids"])))
    return rows


def write_rows(rows: list[TraceRow], path: Path, output_length: int) -> None:
    """Rows as a Mooncake-format trace file (the variants keep no output lengths: one for all)."""
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": output_length, "hash_ids": list(r.hash_ids)}) + "\n")


def _fresh_ids(rows: list[TraceRow]):
    top = max((max(r.hash_ids) for r in rows if r.hash_ids), default=0)
    n = top
    while True:
        n += 1
        yield n


def less_sharing(rows: list[TraceRow], seed: int) -> list[TraceRow]:
    """Half of the requests (at random) share nothing: all their ids are fresh."""
    rng, fresh = random.Random(seed), _fresh_ids(rows)
    return [replace(r, hash_ids=tuple(next(fresh) for _ in r.hash_ids)) if rng.random() < 0.5 else r for r in rows]


def more_sharing(rows: list[TraceRow], seed: int) -> list[TraceRow]:
    """Every request is followed 5 s later by a next turn: its whole prompt plus two fresh blocks."""
    fresh = _fresh_ids(rows)
    turns = [TraceRow(r.timestamp_ms + 5000, r.input_length + 2 * BLOCK, (*r.hash_ids, next(fresh), next(fresh)))
             for r in rows]
    return sorted(rows + turns, key=lambda r: r.timestamp_ms)


def bursts(rows: list[TraceRow], seed: int) -> list[TraceRow]:
    """Arrivals snapped to 10 s windows: each window's requests come at once."""
    return [replace(r, timestamp_ms=r.timestamp_ms // 10_000 * 10_000) for r in rows]


def long_prompts(rows: list[TraceRow], seed: int) -> list[TraceRow]:
    """Only the requests at or above the median prompt length."""
    cut = statistics.median(r.input_length for r in rows)
    return [r for r in rows if r.input_length >= cut]


def short_prompts(rows: list[TraceRow], seed: int) -> list[TraceRow]:
    """Only the requests below the median prompt length."""
    cut = statistics.median(r.input_length for r in rows)
    return [r for r in rows if r.input_length < cut]


# name -> (rewrite, prefill workers)
VARIANTS: dict[str, tuple[Callable[[list[TraceRow], int], list[TraceRow]], int]] = {
    "trace as is": (lambda rows, seed: rows, 2),
    "less sharing": (less_sharing, 2),
    "more sharing (next turns)": (more_sharing, 2),
    "bursts": (bursts, 2),
    "long prompts": (long_prompts, 2),
    "short prompts": (short_prompts, 2),
    "4 workers": (lambda rows, seed: rows, 4),
}
