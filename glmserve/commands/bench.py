"""`glmserve bench replay|agent|compare`: the HTTP load harness (`glmserve.loadgen`) from the
command line. Prints the run's summary and where its report went."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "mooncake_synthetic_trace.jsonl"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root or its /v1 base")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--out", type=Path, required=True, help="directory for report.json, requests.jsonl, report.html")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=None, help="requests (agent: sessions) in flight at most")
    p.add_argument("--max-output-tokens", type=int, default=None)
    p.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=2,tpot=0.05,e2e=30 (seconds; or 200ms)")
    p.add_argument("--cancel-after-chunks", type=int, default=None, help="close the stream after N output chunks")
    p.add_argument("--cancel-after-s", type=float, default=None, help="close the stream after T seconds")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers that refuse it)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="a request still running then is an error")
    p.add_argument("--metrics", action="store_true", help="snapshot the server's /metrics before and after")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=0)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server over HTTP")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    replay = kinds.add_parser("replay", help="replay a Mooncake-format trace")
    replay.add_argument("trace", type=Path, nargs="?", default=DEFAULT_TRACE,
                        help="trace JSONL (default: the bundled Mooncake synthetic trace)")
    _common(replay)
    replay.add_argument("--max-requests", type=int, default=None)
    replay.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's timestamps by X")
    replay.add_argument("--tokens-per-block", type=int, default=512, help="a 512-token trace block becomes T tokens")
    replay.add_argument("--max-input-tokens", type=int, default=None)
    replay.add_argument("--rate", default=None, help="requests/s instead of the trace's times; inf; or a sweep 1,2,4")
    replay.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    replay.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    replay.add_argument("--prompt-format", choices=["tokens", "text"], default="tokens",
                        help="token-id prompts (exact prefixes) or text blocks (for chat or servers without them)")
    replay.add_argument("--tokenizer", type=Path, default=None,
                        help="model dir whose tokenizer sizes text blocks and bounds token ids")
    replay.add_argument("--token-range", default="1000:8000", help="LO:HI token ids for token blocks (no tokenizer)")
    replay.add_argument("--cancel-fraction", type=float, default=1.0, help="share of requests the cancel rule hits")
    replay.add_argument("--chunk-logprobs", action="store_true",
                        help="ask for logprobs to learn the tokens in each streamed chunk")
    agent = kinds.add_parser("agent", help="synthetic coding-agent sessions")
    _common(agent)
    from glmserve.loadgen.agent_sessions import AgentConfig

    d = AgentConfig(model="")
    for name, kind, help_ in (
        ("sessions", int, "sessions in the run"), ("turns", int, "requests per session"),
        ("session-rate", float, "new sessions per second (default: all at once)"),
        ("repos", int, "repositories the sessions share"), ("system-tokens", int, "shared system prompt"),
        ("tools", int, "tool schemas (shared)"), ("repo-tokens", int, "repository context opening a session"),
        ("task-tokens", int, "user message"), ("tool-result-tokens", int, "each tool result"),
        ("max-parallel-tools", int, "tool calls per turn at most (1..N, parallel)"),
        ("follow-up-fraction", float, "share of turns answered by the user instead of tools"),
        ("think-s", float, "mean user think time"), ("tool-wait-s", float, "mean tool run time"),
        ("cancel-fraction", float, "share of turns the cancel rule hits"),
        ("session-header", str, "header carrying the session id ('' for none)"),
    ):
        agent.add_argument(f"--{name}", type=kind, default=getattr(d, name.replace("-", "_")), help=help_)
    cmp_ = kinds.add_parser("compare", help="two runs side by side")
    cmp_.add_argument("runs", type=Path, nargs=2)
    cmp_.add_argument("--html", type=Path, default=None, help="where to write the overlaid plots")


def _base_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def _token_range(text: str) -> range:
    lo, _, hi = text.partition(":")
    try:
        r = range(int(lo), int(hi))
    except ValueError as e:
        raise ValueError(f"token_range: expected LO:HI, got {text!r}") from e
    if len(r) < 2:
        raise ValueError(f"token_range: needs at least two ids, got {text!r}")
    return r


def _cancel_rule(args: argparse.Namespace):
    from glmserve.loadgen.stream_client import CancelRule

    if args.cancel_after_chunks is None and args.cancel_after_s is None:
        return None
    return CancelRule(args.cancel_after_chunks, args.cancel_after_s)


async def _served_model(client) -> str:
    response = await client.http.get("/v1/models", timeout=30)
    data = response.json().get("data") if response.status_code == 200 else None
    if not data:
        raise ValueError(f"model: not given and {client.http.base_url}/v1/models lists none ({response.status_code})")
    return data[0]["id"]


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k not in ("command", "bench_command", "api_key")}


async def _run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    from glmserve.loadgen.progress import LiveProgress
    from glmserve.loadgen.report import build_report, write_run
    from glmserve.loadgen.run_summary import SLO
    from glmserve.loadgen.server_metrics import snapshot
    from glmserve.loadgen.stream_client import StreamClient

    slo = SLO.from_arg(args.slo)
    config, entries, tokenizer = _config(args)  # bad arguments or a bad trace fail before anything is sent
    connections = args.concurrency + 8 if args.concurrency else 1024
    client = StreamClient(_base_url(args.url), args.api_key, args.timeout_s, max_connections=connections)
    try:
        if not config.model:
            config = dataclasses.replace(config, model=await _served_model(client))
        before = await snapshot(client.http) if args.metrics else None
        with LiveProgress(enabled=not args.no_progress) as progress:
            if args.bench_command == "agent":
                from glmserve.loadgen.agent_sessions import AgentRun

                sections = [("agent", None, await AgentRun(config, client, progress).run())]
            else:
                from glmserve.loadgen.replay import ReplayRun

                sections = await ReplayRun(config, client, progress, tokenizer, entries).run()
        after = await snapshot(client.http) if args.metrics else None
    finally:
        await client.aclose()
    report = build_report(args.bench_command, command, {**_settings(args), "model": config.model}, sections, slo,
                          (before, after))
    write_run(args.out, report, [r for _, _, rs in sections for r in rs], (before, after))
    return report


def _config(args: argparse.Namespace):
    """(config, trace entries, tokenizer) from the command line; the model name may be left empty."""
    cancel = _cancel_rule(args)
    if args.bench_command == "agent":
        from glmserve.loadgen.agent_sessions import AgentConfig

        return AgentConfig.from_args(args, cancel), None, None
    from glmserve.loadgen.replay import ReplayConfig, token_id_pool
    from glmserve.loadgen.trace import load_trace

    tokenizer = None
    if args.tokenizer is not None:
        from glmserve.text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(args.tokenizer)
    pool = token_id_pool(tokenizer, _token_range(args.token_range))
    return ReplayConfig.from_args(args, cancel, pool), load_trace(args.trace, args.max_requests), tokenizer


def print_summary(report: dict[str, Any], out: Path) -> None:
    from glmserve.loadgen.report_html import ROWS, cell

    columns = {s["label"]: s for s in report["sections"]} if len(report["sections"]) > 1 else {"run": report}
    width = max(len(name) for name, _, _ in ROWS) + 2
    print(" " * width + "".join(f"{label:>24}" for label in columns))
    for name, key, fmt in ROWS:
        print(f"{name:<{width}}" + "".join(f"{cell(s, key, fmt):>24}" for s in columns.values()))
    if report["errors_by_kind"]:
        print(f"errors by kind: {report['errors_by_kind']}")
    print(f"report: {out / 'report.json'}, {out / 'report.html'}, {out / 'requests.jsonl'}")


def run_bench(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    if args.bench_command == "compare":
        from glmserve.loadgen.compare import compare

        try:
            print(compare(args.runs[0], args.runs[1], args.html))
        except ValueError as e:
            print(f"glmserve bench compare: {e}", file=sys.stderr)
            return 2
        return 0
    command = "glmserve " + shlex.join(argv if argv is not None else sys.argv[1:])
    try:
        report = asyncio.run(_run(args, command))
    except ValueError as e:  # bad arguments or a bad trace: say which, start nothing
        print(f"glmserve bench {args.bench_command}: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"glmserve bench {args.bench_command}: cannot reach {args.url}: {e!r}", file=sys.stderr)
        return 2
    print_summary(report, args.out)
    return 0 if report["completed"] + report["cancelled"] == report["requests"] else 1
