"""``glmserve bench compare DIR1 DIR2``: two runs' summaries side by side (with the ratio
second / first) on stdout, and their plots overlaid in one HTML page."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from glmserve.loadgen.report import read_run
from glmserve.loadgen.report_html import ROWS

_PCT = ("p50", "p90", "p99")


def _values(summary: dict[str, Any], key: str, fmt: str) -> list[tuple[str, Any]]:
    value = summary.get(key)
    if fmt == "pct":
        return [(p, (value or {}).get(p)) for p in _PCT]
    return [("", value)]


def comparison_table(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> str:
    w = max(16, *(len(n) + 2 for n in names))
    lines = [f"{'metric':<32}{names[0]:>{w}}{names[1]:>{w}}{'ratio':>10}"]
    for label, key, fmt in ROWS:
        base = label.split(" p50")[0]
        for part, va in _values(a, key, fmt):
            vb = dict(_values(b, key, fmt))[part]
            name = f"{base} {part}".strip()
            ratio = f"{vb / va:.3f}" if isinstance(va, int | float) and isinstance(vb, int | float) and va else "-"
            lines.append(f"{name:<32}{_fmt(va):>{w}}{_fmt(vb):>{w}}{ratio:>10}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def run_names(a: Path, b: Path) -> tuple[str, str]:
    na, nb = Path(a).resolve().name, Path(b).resolve().name
    return (f"A:{na}", f"B:{nb}") if na == nb else (na, nb)


def compare(dir_a: Path, dir_b: Path, out_html: Path | None = None) -> str:
    """The comparison table; writes the overlaid plots to ``out_html`` (default: beside DIR2)."""
    (report_a, records_a), (report_b, records_b) = read_run(dir_a), read_run(dir_b)
    names = run_names(dir_a, dir_b)
    text = comparison_table(report_a, report_b, names)
    from glmserve.loadgen.report_html import page  # matplotlib is loaded only here

    out_html = out_html or Path(dir_b).resolve().parent / f"compare_{names[0]}_vs_{names[1]}.html"
    intro = "".join(f"<p><b>{html.escape(n)}</b>: <code>{html.escape(r['command'])}</code></p>"
                    for n, r in zip(names, (report_a, report_b), strict=True))
    out_html.write_text(page("glmserve bench compare", intro, dict(zip(names, (report_a, report_b), strict=True)),
                             dict(zip(names, (records_a, records_b), strict=True))))
    return text + f"\n\nplots: {out_html}"

