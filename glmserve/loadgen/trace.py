"""Mooncake-format request traces: one JSON object a line with ``timestamp`` (ms from the start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (one id per 512-token block of
the prompt, prefix-chained: two requests share block i only if they share blocks 0..i).

`load_trace` checks every line and raises `TraceError` naming the file, the line and the field.
`scaled_input_length` maps a trace prompt onto ``tokens_per_block`` tokens a block.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512  # the block size Mooncake's hash ids stand for
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace that cannot be replayed; the message says where and why."""


@dataclass(frozen=True)
class TraceEntry:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int_field(row: dict, name: str, where: str, minimum: int) -> int:
    value = row[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{where}: {name}: expected an integer >= {minimum}, got {json.dumps(value)[:60]}")
    return value


def parse_entry(line: str, where: str) -> TraceEntry:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise TraceError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object")
    missing = [f for f in _FIELDS if f not in row]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)} (Mooncake format: {', '.join(_FIELDS)})")
    timestamp = row["timestamp"]
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or not math.isfinite(timestamp) \
            or timestamp < 0:
        raise TraceError(f"{where}: timestamp: expected milliseconds >= 0, got {json.dumps(timestamp)[:60]}")
    input_length = _int_field(row, "input_length", where, 1)
    output_length = _int_field(row, "output_length", where, 1)
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceError(f"{where}: hash_ids: expected an array of integers")
    blocks = math.ceil(input_length / TRACE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise TraceError(f"{where}: hash_ids: {len(ids)} ids for input_length {input_length}, expected "
                         f"ceil({input_length} / {TRACE_BLOCK_TOKENS}) = {blocks}")
    return TraceEntry(timestamp / 1000.0, input_length, output_length, tuple(ids))


def load_trace(path: Path, max_requests: int | None = None) -> list[TraceEntry]:
    """The first ``max_requests`` entries (all when None), in file order; timestamps must not go back."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    entries: list[TraceEntry] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if max_requests is not None and len(entries) >= max_requests:
                break
            if not line.strip():
                continue
            entry = parse_entry(line, f"{path.name} line {number}")
            if entries and entry.timestamp_s < entries[-1].timestamp_s:
                raise TraceError(f"{path.name} line {number}: timestamp: goes back in time "
                                 f"({entry.timestamp_s * 1000:.0f} ms after {entries[-1].timestamp_s * 1000:.0f} ms)")
            entries.append(entry)
    if not entries:
        raise TraceError(f"{path}: the trace has no requests")
    return entries


def scaled_input_length(entry: TraceEntry, tokens_per_block: int) -> int:
    """Prompt tokens at ``tokens_per_block`` tokens a block: full blocks scale exactly, the partial
    last block in proportion (at least one token)."""
    last = entry.input_length - TRACE_BLOCK_TOKENS * (len(entry.hash_ids) - 1)
    return tokens_per_block * (len(entry.hash_ids) - 1) + max(1, math.ceil(last * tokens_per_block / TRACE_BLOCK_TOKENS))
