"""The harness's matplotlib figures, each over ``groups`` (label -> records: a run's sections, or
two runs in `compare`): latency CDFs, TTFT against prompt length, throughput and concurrency over
time, cached-token ratio by turn (agent sessions) or by position in the run (replays)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator, NullFormatter  # noqa: E402

from glmserve.loadgen.request_record import RequestRecord  # noqa: E402

Groups = dict[str, list[RequestRecord]]
_LATENCIES = (("TTFT", lambda r: [r.ttft_s]), ("ITL", lambda r: r.itl_s), ("TPOT", lambda r: [r.tpot_s]),
              ("E2E", lambda r: [r.e2e_s]))


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def latency_cdfs(groups: Groups) -> Figure:
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (name, values) in zip(axes, _LATENCIES, strict=True):
        curves = {label: np.sort([v for r in records if r.status == "ok" for v in values(r) if v is not None])
                  for label, records in groups.items()}
        curves = {label: xs for label, xs in curves.items() if xs.size}
        for label, xs in curves.items():
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label)
        low = min((xs[0] for xs in curves.values()), default=0.0)
        high = max((xs[-1] for xs in curves.values()), default=0.0)
        if low > 0 and high / low > 30:  # log only for a wide spread; no minor labels
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(title=f"{name} CDF", xlabel="seconds", ylabel="fraction of requests" if name == "TTFT" else None)
        ax.grid(alpha=0.3)
    _legend(axes[0])
    fig.tight_layout()
    return fig


def ttft_vs_prompt(groups: Groups) -> Figure:
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, records in groups.items():
        pts = [(r.prompt_length, r.ttft_s) for r in records if r.status == "ok" and r.prompt_length and r.ttft_s]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=8, alpha=0.6, label=label)
    ax.set(title="TTFT vs prompt length", xlabel="prompt tokens", ylabel="TTFT (s)")
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    return fig


def _chunk_times(r: RequestRecord) -> tuple[np.ndarray, np.ndarray]:
    """When each output chunk arrived (run clock) and how many tokens it carried (spread evenly
    when the server did not say)."""
    if r.ttft_s is None:
        return np.empty(0), np.empty(0)
    times = r.start_s + r.ttft_s + np.concatenate([[0.0], np.cumsum(r.itl_s)])
    if r.chunk_tokens and len(r.chunk_tokens) == times.size:
        return times, np.asarray(r.chunk_tokens, dtype=float)
    total = r.output_tokens if r.output_tokens is not None else times.size
    return times, np.full(times.size, total / times.size)


def timeline(groups: Groups, bins: int = 60) -> Figure:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    for label, records in groups.items():
        if not records:
            continue
        end = max(r.end_s for r in records)
        edges = np.linspace(min(r.start_s for r in records), end, bins + 1)
        width = edges[1] - edges[0] or 1.0
        tokens = np.zeros(bins)
        for r in records:
            times, counts = _chunk_times(r)
            if times.size:
                tokens += np.histogram(times, edges, weights=counts)[0]
        top.plot(edges[:-1] + width / 2, tokens / width, label=label)
        steps = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])
        bottom.step([t for t, _ in steps], np.cumsum([s for _, s in steps]), where="post", label=label)
    top.set(title="output throughput over time", ylabel="tokens / s")
    bottom.set(title="requests in flight", xlabel="seconds since the run started", ylabel="requests")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    _legend(top)
    fig.tight_layout()
    return fig


def cache_hits(groups: Groups, parts: int = 10) -> Figure:
    """By turn when the records have turns; else by tenth of the run, in send order."""
    fig, ax = plt.subplots(figsize=(7, 4))
    by_turn = any(r.turn is not None for rs in groups.values() for r in rs)
    for label, records in groups.items():
        ok = [r for r in records if r.status == "ok" and r.prompt_tokens and r.cached_tokens is not None]
        ok.sort(key=lambda r: r.start_s)
        keys = [r.turn for r in ok] if by_turn else [i * parts // max(1, len(ok)) for i in range(len(ok))]
        sums: dict[int, list[int]] = {}
        for key, r in zip(keys, ok, strict=True):
            s = sums.setdefault(key, [0, 0])
            s[0] += r.cached_tokens
            s[1] += r.prompt_tokens
        if sums:
            xs = sorted(sums)
            ax.plot(xs, [sums[x][0] / sums[x][1] for x in xs], marker="o", label=label)
    ax.set(title="cached-token ratio by turn" if by_turn else "cached-token ratio over the run",
           xlabel="turn" if by_turn else f"part of the run (1/{parts}, send order)",
           ylabel="cached / prompt tokens", ylim=(0, 1.05))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    _legend(ax)
    fig.tight_layout()
    return fig


ALL = (latency_cdfs, ttft_vs_prompt, timeline, cache_hits)
