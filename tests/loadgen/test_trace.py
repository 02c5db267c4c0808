"""Mooncake traces: the bundled trace loads, bad traces are refused with the line and the field,
and trace prompts scale by ``tokens_per_block``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmserve.commands.bench import DEFAULT_TRACE
from glmserve.loadgen.trace import TraceEntry, TraceError, load_trace, scaled_input_length

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_bundled_trace_loads_in_full() -> None:
    entries = load_trace(DEFAULT_TRACE)
    assert len(entries) == 3993
    assert entries[0] == TraceEntry(0.0, 40160, 6, tuple(range(79)))
    assert entries[-1].timestamp_s == pytest.approx(1022.025)
    assert len(load_trace(DEFAULT_TRACE, max_requests=5)) == 5
    assert "Apache License" in (DEFAULT_TRACE.parent / "LICENSE").read_text()  # its notice ships with it
    assert "Mooncake" in (DEFAULT_TRACE.parent / "README.md").read_text()


@pytest.mark.parametrize("row,message", [
    ("not json", "line 1: not valid JSON"),
    ("[1, 2]", "line 1: expected a JSON object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "missing field.*hash_ids"),
    (json.dumps({**GOOD, "input_length": 0}), "input_length: expected an integer >= 1"),
    (json.dumps({**GOOD, "output_length": "5"}), "output_length: expected an integer"),
    (json.dumps({**GOOD, "timestamp": -1}), "timestamp: expected milliseconds >= 0"),
    (json.dumps({**GOOD, "hash_ids": [1, "2"]}), "hash_ids: expected an array of integers"),
    (json.dumps({**GOOD, "hash_ids": [1]}), r"hash_ids: 1 ids for input_length 1000, expected ceil\(1000 / 512\) = 2"),
])
def test_a_bad_line_names_the_line_and_the_field(tmp_path: Path, row: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path, row))


def test_time_going_back_empty_and_missing_traces_are_refused(tmp_path: Path) -> None:
    later = json.dumps({**GOOD, "timestamp": 50})
    with pytest.raises(TraceError, match="line 2: timestamp: goes back in time"):
        load_trace(write(tmp_path, later, json.dumps(GOOD)))
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path, ""))
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "absent.jsonl")


def test_the_cli_reports_a_bad_trace_and_sends_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from glmserve.cli import main

    bad = write(tmp_path, json.dumps(GOOD), json.dumps({**GOOD, "hash_ids": []}))
    # The URL is one nothing listens on: the trace is checked before anything is sent.
    status = main(["bench", "replay", str(bad), "--url", "http://127.0.0.1:9", "--model", "m",
                   "--out", str(tmp_path / "out"), "--no-progress"])
    assert status == 2
    assert "t.jsonl line 2: hash_ids: 0 ids for input_length 1000" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_prompts_scale_by_tokens_per_block() -> None:
    entry = TraceEntry(0.0, 512 * 2 + 100, 1, (1, 2, 3))
    assert scaled_input_length(entry, 512) == 1124
    assert scaled_input_length(entry, 32) == 64 + 7  # ceil(100 * 32 / 512)
    assert scaled_input_length(TraceEntry(0.0, 1, 1, (9,)), 16) == 1  # never empty
