"""``report.html``: a summary table and the `plots`, PNGs embedded (one self-contained file)."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from glmserve.loadgen import plots
from glmserve.loadgen.request_record import RequestRecord

ROWS = (("requests", "requests", "{}"), ("completed", "completed", "{}"), ("errors", "errors", "{}"),
        ("cancelled", "cancelled", "{}"), ("TTFT p50 / p90 / p99 (s)", "ttft_s", "pct"),
        ("ITL p50 / p90 / p99 (s)", "itl_s", "pct"), ("TPOT p50 / p90 / p99 (s)", "tpot_s", "pct"),
        ("E2E p50 / p90 / p99 (s)", "e2e_s", "pct"), ("output tokens / s", "output_tokens_per_s", "{:.1f}"),
        ("requests / s", "requests_per_s", "{:.2f}"), ("goodput (requests / s)", "goodput_requests_per_s", "{:.2f}"),
        ("cached-token ratio", "cached_token_ratio", "{:.3f}"), ("max concurrency", "max_concurrency", "{}"))


def cell(summary: dict[str, Any], key: str, fmt: str) -> str:
    value = summary.get(key)
    if fmt == "pct":
        if not isinstance(value, dict) or value.get("p50") is None:
            return "-"
        return " / ".join(f"{value[p]:.3g}" for p in ("p50", "p90", "p99"))
    return "-" if value is None else fmt.format(value)


def png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def table(columns: dict[str, dict[str, Any]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(f"<tr><td>{name}</td>" + "".join(f"<td>{cell(s, key, fmt)}</td>" for s in columns.values())
                   + "</tr>" for name, key, fmt in ROWS)
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


def page(title: str, intro: str, columns: dict[str, dict[str, Any]], groups: plots.Groups) -> str:
    figures = "".join(f"<div>{png(make(groups))}</div>" for make in plots.ALL)
    style = "body{font-family:sans-serif} td,th{padding:2px 10px;text-align:right} code{background:#eee}"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{intro}"
            f"{table(columns)}{figures}</body></html>")


def write_html(path: Path, report: dict[str, Any], records: list[RequestRecord]) -> None:
    sections = report["sections"]
    columns = {s["label"]: s for s in sections} if len(sections) > 1 else {"run": report}
    groups = {s["label"]: [r for r in records if r.section == s["label"]] for s in sections}
    intro = f"<p><code>{html.escape(report['command'])}</code><br>{html.escape(report['date'])}</p>"
    Path(path).write_text(page(f"glmserve bench {report['kind']}", intro, columns, groups))
