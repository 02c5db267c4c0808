"""Routing over HTTP: the Mooncake trace replayed through `glmserve serve` (real router, prefill
and decode workers, kvstore) with ``--routing cache_aware``, ``least_loaded`` and ``round_robin``,
by `glmserve bench replay`; then, with ``--agent``, agent sessions per routing policy as well.
With ``--variants``, the trace's variants (`bench/trace_variants.py`: less and more sharing, bursts,
long and short prompts, 4 prefill workers) are replayed too, each timed so that it offers the same
prompt tokens per second (``--offered-tokens-per-s``), and a summary prints cache-aware / least-loaded
TTFT ratios per variant.

For each round, each policy in turn (rotated every round, so each takes every place): start a
fresh platform (empty caches), replay the same requests, stop it. Prints one markdown row per run
with the report's figures, and the platform's CPU share (CPU seconds of all its processes / (wall
x cores)) and the load average, so a reader sees how much of the machine the run got.

    python bench/bench_routing_http.py --out runs/routing [--rounds 1 --prefill-workers 2
        --replay-args "--max-requests 200 --tokens-per-block 32 --time-scale 2 --max-output-tokens 32"]
    python bench/bench_routing_http.py --out runs/variants --skip-replay --variants all \
        --policies cache_aware,least_loaded --variant-requests 1000 --offered-tokens-per-s 2500
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.trace_variants import VARIANTS, read_rows, write_rows  # noqa: E402
from glmserve.loadgen.trace import TRACE_BLOCK_TOKENS  # noqa: E402

TRACE = REPO / "bench" / "traces" / "mooncake_synthetic_trace.jsonl"
POLICIES = ("cache_aware", "least_loaded", "round_robin")
REPLAY = "--max-requests 200 --tokens-per-block 32 --time-scale 2 --max-output-tokens 32 --slo ttft=5,tpot=0.5"
VARIANT_REPLAY = "--tokens-per-block 8 --max-output-tokens 8 --slo ttft=2,tpot=0.2"
AGENT = ("--sessions 8 --turns 5 --concurrency 4 --max-output-tokens 24 --system-tokens 400 --repo-tokens 800 "
         "--tool-result-tokens 200 --tools 4 --think-s 1 --tool-wait-s 0.5 --cancel-after-chunks 4 "
         "--cancel-fraction 0.1 --slo ttft=5,tpot=0.5")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--replay-args", default=REPLAY)
    p.add_argument("--agent", action="store_true", help="also run agent sessions per policy")
    p.add_argument("--agent-args", default=AGENT)
    p.add_argument("--skip-replay", action="store_true")
    p.add_argument("--serve-args", default="", help="more `glmserve serve` arguments, e.g. --host-tier-bytes 0")
    p.add_argument("--variants", default="", help="'all' or comma-separated names from bench/trace_variants.py")
    p.add_argument("--variant-requests", type=int, default=1000, help="variants rewrite the trace's first N rows")
    p.add_argument("--offered-tokens-per-s", type=float, default=2500.0,
                   help="each variant's time scale makes it offer this many prompt tokens a second")
    p.add_argument("--max-requests-per-s", type=float, default=15.0,
                   help="and at most this many requests a second (short prompts would come too fast)")
    p.add_argument("--variant-replay-args", default=VARIANT_REPLAY,
                   help="replay arguments for the variants (no trace, --max-requests or --time-scale)")
    return p.parse_args(argv)


def _cpu_seconds(root: int) -> float:
    """utime + stime of ``root`` and every live descendant (from /proc)."""
    parents, times = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parents[pid], times[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total, frontier = 0.0, [root]
    while frontier:
        pid = frontier.pop()
        total += times.get(pid, 0.0)
        frontier += [c for c, p in parents.items() if p == pid]
    return total


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


class Platform:
    def __init__(self, policy: str, args: argparse.Namespace, log: Path):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glmserve.cli", "serve", "--port", "0", "--routing", policy,
             "--prefill-workers", str(args.prefill_workers), "--decode-workers", str(args.decode_workers),
             *shlex.split(args.serve_args)],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=REPO)
        self.url = None
        for line in self.proc.stdout:
            match = re.search(r"serving \S+ at (http://\S+)/v1", line)
            if match:
                self.url = match.group(1)
                break
        if self.url is None:
            raise RuntimeError(f"glmserve serve did not start; see {log}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=120)
        self.log.close()


def start_platform(policy: str, args: argparse.Namespace, log: Path, attempts: int = 3) -> Platform:
    """A platform start can lose a race for a free port to another process on a busy machine: retry."""
    for attempt in range(attempts):
        try:
            return Platform(policy, args, log)
        except RuntimeError:
            if attempt == attempts - 1:
                raise
            print(f"(glmserve serve did not start, attempt {attempt + 1}; see {log}; retrying)", file=sys.stderr)
    raise AssertionError("unreachable")


def run_one(kind: str, policy: str, round_: int, args: argparse.Namespace, extra: list[str] | None = None,
            tag: str = "") -> dict:
    """One fresh platform, one `glmserve bench KIND` run against it (``extra``: its arguments)."""
    name = f"{kind}{tag}-{policy}-r{round_}"
    out = args.out / name
    platform = start_platform(policy, args, args.out / f"{name}.serve.log")
    try:
        load_start, cpu_start, wall_start = _load(), _cpu_seconds(platform.proc.pid), time.monotonic()
        if extra is None:
            extra = shlex.split(args.replay_args if kind == "replay" else args.agent_args)
        cmd = [sys.executable, "-m", "glmserve.cli", "bench", kind, "--url", platform.url, "--out", str(out),
               "--metrics", "--no-progress", *extra]
        subprocess.run(cmd, check=False, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                       stdout=subprocess.DEVNULL)
        wall = time.monotonic() - wall_start
        share = (_cpu_seconds(platform.proc.pid) - cpu_start) / (wall * (os.cpu_count() or 1))
        load_end = _load()
    finally:
        platform.stop()
    report = json.loads((out / "report.json").read_text())
    decisions = {re.search(r'reason="([^"]+)"', k).group(1): int(v)
                 for k, v in report.get("server_metrics_delta", {}).items()
                 if k.startswith("glmserve_router_routing_decisions_total")}
    return {"kind": kind, "policy": policy, "round": round_, "report": report, "wall": wall, "share": share,
            "load": f"{load_start} -> {load_end}", "decisions": decisions, "dir": out}


def row(r: dict) -> str:
    rep = r["report"]
    total = sum(r["decisions"].values()) or 1
    decisions = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(r["decisions"].items()) if v)
    cells = [r["policy"], r["round"], f"{rep['completed']}/{rep['requests']}", rep["errors"], rep["cancelled"],
             f"{rep['cached_token_ratio']:.1%}", *(f"{rep[k]['p50']:.2f} / {rep[k]['p90']:.2f}"
                                                 if rep[k]["p50"] is not None else "-" for k in ("ttft_s", "e2e_s")),
             f"{rep['itl_s']['p50'] * 1000:.1f}" if rep["itl_s"]["p50"] is not None else "-", f"{rep['output_tokens_per_s']:.1f}",
             f"{rep['goodput_fraction']:.0%}", decisions or "-", f"{r['share']:.0%}", r["load"]]
    return "| " + " | ".join(str(c) for c in cells) + " |"


HEADER = ("| routing | round | completed | errors | cancelled | cached-token ratio | TTFT p50 / p90 s | "
          "E2E p50 / p90 s | ITL p50 ms | output tok/s | goodput | decisions | platform CPU | load avg |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def variant_trace(name: str, args: argparse.Namespace, tokens_per_block: int) -> tuple[Path, int, float, int]:
    """Write variant ``name`` of the trace's first rows; (file, prefill workers, time scale, requests).
    The time scale makes the variant offer ``--offered-tokens-per-s`` prompt tokens a second, or
    ``--max-requests-per-s`` requests where that is the slower."""
    rewrite, workers = VARIANTS[name]
    rows = rewrite(read_rows(TRACE, args.variant_requests), 0)
    path = args.out / f"trace-{_slug(name)}.jsonl"
    write_rows(rows, path, output_length=64)
    tokens = sum(tokens_per_block * (r.input_length / TRACE_BLOCK_TOKENS) for r in rows)
    span_s = max((rows[-1].timestamp_ms - rows[0].timestamp_ms) / 1000.0, 1.0)
    scale = max(tokens / args.offered_tokens_per_s, len(rows) / args.max_requests_per_s) / span_s
    return path, workers, scale, len(rows)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _option(argv: list[str], name: str, default: int) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


def run_variants(args: argparse.Namespace, policies: list[str]) -> None:
    """Each variant with each policy (rotated per round) on a fresh platform; then the ratios."""
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    replay_args = shlex.split(args.variant_replay_args)
    tokens_per_block = _option(replay_args, "--tokens-per-block", TRACE_BLOCK_TOKENS)
    print(f"\nvariants: the first {args.variant_requests} trace rows rewritten, offering "
          f"{args.offered_tokens_per_s:g} prompt tokens/s (at most {args.max_requests_per_s:g} requests/s); "
          f"`glmserve bench replay TRACE --time-scale S "
          f"{args.variant_replay_args}`\n")
    head, rule = HEADER.split("\n")
    print("| variant | requests | prefill workers | time scale " + head + "\n|---|---|---|---" + rule, flush=True)
    results: dict[str, dict[str, list[dict]]] = {}
    for name in names:
        path, workers, scale, n = variant_trace(name, args, tokens_per_block)
        run_args = argparse.Namespace(**{**vars(args), "prefill_workers": workers})
        extra = [str(path), "--time-scale", f"{scale:.4f}", *replay_args]
        for round_ in range(args.rounds):
            for policy in policies[round_ % len(policies):] + policies[: round_ % len(policies)]:
                r = run_one("replay", policy, round_, run_args, extra, tag=f"-{_slug(name)}")
                results.setdefault(name, {}).setdefault(policy, []).append(r)
                print(f"| {name} | {n} | {workers} | {scale:.3f} " + row(r), flush=True)
    if {"cache_aware", "least_loaded"} <= set(policies):
        print_variant_ratios(results)


def print_variant_ratios(results: dict[str, dict[str, list[dict]]]) -> None:
    """Cache-aware over least-loaded per variant (medians over rounds): TTFT mean and p90, hits."""
    def median(runs: list[dict], key) -> float:
        return statistics.median(key(r["report"]) for r in runs)

    print("\n| variant | TTFT mean ca / ll s | mean ca/ll | TTFT p90 ca / ll s | p90 ca/ll | "
          "cached-token ratio ca / ll | ca wins |\n|---|---|---|---|---|---|---|")
    for name, by_policy in results.items():
        ca, ll = by_policy["cache_aware"], by_policy["least_loaded"]
        cells = []
        for key in (lambda rep: rep["ttft_s"]["mean"], lambda rep: rep["ttft_s"]["p90"]):
            a, b = median(ca, key), median(ll, key)
            cells += [f"{a:.2f} / {b:.2f}", f"{a / b:.2f}"]
        hit_ca, hit_ll = (median(runs, lambda rep: rep["cached_token_ratio"]) for runs in (ca, ll))
        wins = float(cells[1]) < 1 and float(cells[3]) < 1 and hit_ca >= hit_ll
        print(f"| {name} | " + " | ".join(cells) + f" | {hit_ca:.1%} / {hit_ll:.1%} | {'yes' if wins else 'no'} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",")
    kinds = ([] if args.skip_replay else ["replay"]) + (["agent"] if args.agent else [])
    print(f"- command: `python bench/bench_routing_http.py {shlex.join(argv if argv is not None else sys.argv[1:])}`")
    print(f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; "
          f"`glmserve serve --prefill-workers {args.prefill_workers} --decode-workers {args.decode_workers} "
          f"{args.serve_args}`")
    for kind in kinds:
        print(f"\n{kind}: `glmserve bench {kind} {args.replay_args if kind == 'replay' else args.agent_args}`\n")
        print(HEADER, flush=True)
        for round_ in range(args.rounds):
            for policy in policies[round_ % len(policies):] + policies[: round_ % len(policies)]:
                print(row(run_one(kind, policy, round_, args)), flush=True)
    if args.variants:
        run_variants(args, policies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
