"""A run's outputs in ``DIR``: ``report.json`` (the command line, the whole run's summary at the top
level and one entry per section in ``sections``), ``requests.jsonl`` (one `RequestRecord` a line),
``report.html`` (plots, `report_html`), and the server's ``metrics_before.txt`` /
``metrics_after.txt`` when asked for."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from glmserve.loadgen.request_record import RequestRecord, read_jsonl, write_jsonl
from glmserve.loadgen.run_summary import SLO, summarize
from glmserve.loadgen.server_metrics import metrics_delta

Section = tuple[str, float | None, list[RequestRecord]]


def build_report(kind: str, command: str, settings: dict[str, Any], sections: list[Section], slo: SLO,
                 metrics: tuple[str | None, str | None] = (None, None)) -> dict[str, Any]:
    records = [r for _, _, rs in sections for r in rs]
    report: dict[str, Any] = {
        "kind": kind,
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": settings,
        **summarize(records, slo),
        "sections": [{"label": label, "rate": rate, **summarize(rs, slo)} for label, rate, rs in sections],
    }
    if kind == "agent":
        report["cached_token_ratio_by_turn"] = ratio_by_turn(records)
    if metrics[0] is not None and metrics[1] is not None:
        report["server_metrics_delta"] = metrics_delta(*metrics)
    return report


def ratio_by_turn(records: list[RequestRecord]) -> dict[str, float]:
    """cached / prompt tokens of completed requests, per turn index."""
    sums: dict[int, list[int]] = {}
    for r in records:
        if r.status == "ok" and r.turn is not None and r.prompt_tokens and r.cached_tokens is not None:
            s = sums.setdefault(r.turn, [0, 0])
            s[0] += r.cached_tokens
            s[1] += r.prompt_tokens
    return {str(t): c / p for t, (c, p) in sorted(sums.items())}


def write_run(out: Path, report: dict[str, Any], records: list[RequestRecord],
              metrics: tuple[str | None, str | None] = (None, None)) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_jsonl(records, out / "requests.jsonl")
    for name, text in zip(("metrics_before.txt", "metrics_after.txt"), metrics, strict=True):
        if text is not None:
            (out / name).write_text(text)
    from glmserve.loadgen.report_html import write_html  # matplotlib is loaded only here

    write_html(out / "report.html", report, records)


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[RequestRecord]]:
    run_dir = Path(run_dir)
    report_path = run_dir / "report.json"
    if not report_path.is_file():
        raise ValueError(f"run: no report.json in {run_dir}")
    records_path = run_dir / "requests.jsonl"
    return json.loads(report_path.read_text()), read_jsonl(records_path) if records_path.is_file() else []
