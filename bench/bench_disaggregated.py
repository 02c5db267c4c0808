"""Disaggregated serving vs one process: the added time to first token, and KV transfer throughput.

(a) TTFT. The same OpenAI front end (the router's FastAPI app) over one in-process engine
(`glmserve serve-local`) and over the platform (`glmserve serve`: kvstore, one prefill and one
decode worker and the router as processes on 127.0.0.1, KV over `--transfer`). Both are up at once
and idle between requests; every prompt goes to one, then the other, one request at a time, so a
slow spell of the machine hits both alike. TTFT: from sending the request with the `openai` client
(streamed completion) to its first chunk. Prompts are random token ids, a fresh one per request (no
prefix-cache hits); one untimed warm-up request per system and length. Every process gets
OMP_NUM_THREADS=1: the single engine and the prefill worker compute a prompt with one thread each.

(b) KV transfer. The bundled model's KV blocks (its `KVLayout`: 64 tokens a block, bf16, all
layers) for 4K- and 32K-token prompts, written by the real backends of `glmserve.kv.transfer`
(NIXL over UCX, and TCP) from this process into a receiver process (`tests/kv/transfer_peer.py`),
write() to "done" (every byte in the receiver's memory), best of `--repeats`; against one in-process
`torch` copy_ of the same bytes, the limit on this host. For scale, the bytes per token of the
real GLM-5.2 layout are printed too (the KV of a 32K prompt there is ~33x the tiny model's).

    python bench/bench_disaggregated.py [--lengths 256,1024,4096 --requests 5 --transfer auto ...]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import int_list, load_average, markdown_table, print_header  # noqa: E402
from glmserve.commands.free_ports import PortPicker  # noqa: E402
from glmserve.kv.transfer import (  # noqa: E402
    make_backend,
    measure_write_throughput,
    memcpy_throughput,
    nixl_unavailable_reason,
)
from glmserve.model.config import GlmConfig  # noqa: E402
from glmserve.model.kv_layout import KVLayout  # noqa: E402
from tests.kv.transfer_peer import ReceiverProcess, make_source  # noqa: E402

GB = 1e9
BLOCK_SIZE = 64
# The real GLM-5.2 (753B) config fields that decide its KV layout (DESIGN.md, "The model").
GLM52_KV = {
    "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
    "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
    "v_head_dim": 256, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "first_k_dense_replace": 3, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "index_topk_freq": 4, "index_skip_topk_offset": 3, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 1048576, "rope_theta": 8000000.0,
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "models" / "glm52-tiny")
    p.add_argument("--lengths", type=int_list, default=[256, 1024, 4096], help="prompt tokens (TTFT)")
    p.add_argument("--requests", type=int, default=5, help="timed requests per system and length")
    p.add_argument("--transfer", choices=["tcp", "nixl", "auto"], default="auto",
                   help="KV transfer of the platform in (a) (auto: NIXL where it imports)")
    p.add_argument("--kv-tokens", type=int_list, default=[4096, 32768], help="prompt tokens worth of KV (b)")
    p.add_argument("--kinds", default="nixl,tcp", help="transfer backends measured in (b)")
    p.add_argument("--repeats", type=int, default=5, help="writes per size and backend; the best counts")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--skip-transfer", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# --- (a) time to first token ------------------------------------------------------------------------


class Server:
    """A server process printing its base URL on stdout; stopped with SIGTERM (its children too)."""

    def __init__(self, name: str, argv: list[str], url_pattern: str, timeout_s: float = 300.0):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NIXL_LOG_LEVEL": "WARN",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        self.name = name
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + timeout_s
        self.url = ""
        while not self.url:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start (exit status {self.proc.returncode})")
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if m := re.search(url_pattern, line):
                self.url = m.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # serve-local has no launcher to stop its children
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


free_port = PortPicker("127.0.0.1").port  # below the ephemeral range: no client socket takes it first


def start_servers(model: Path, transfer: str) -> dict[str, Server]:
    cli = [sys.executable, "-m", "glmserve.cli"]
    local = Server("single process", [*cli, "serve-local", "--model", str(model), "--port", str(free_port())],
                   r"serving \S+ at (http://\S+/v1)")
    try:
        disagg = Server("disaggregated", [*cli, "serve", "--model", str(model), "--port", "0",
                                          "--transfer", transfer], r"serving \S+ at (http://\S+/v1)")
    except RuntimeError:
        local.stop()
        raise
    return {"single process": local, "disaggregated": disagg}


async def wait_ready(url: str, model: str, timeout_s: float = 120.0) -> None:
    """Until a one-token request succeeds (`serve-local` prints its URL before the engine loads)."""
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + timeout_s
    async with client:
        while True:
            try:
                await client.completions.create(model=model, prompt=[11], max_tokens=1)
                return
            except openai.APIError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)


async def ttft(client: openai.AsyncOpenAI, model: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first chunk (the stream then runs out)."""
    start = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    first = None
    async for _ in stream:
        first = time.perf_counter() - start if first is None else first
    if first is None:
        raise RuntimeError("the stream ended without a chunk")
    return first


async def measure_ttft(urls: dict[str, str], model: str, lengths: list[int], requests: int,
                       seed: int) -> dict[tuple[str, int], list[float]]:
    rng = random.Random(seed)
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in urls for n in lengths}
    clients = {name: openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
               for name, url in urls.items()}
    for n in lengths:
        for i in range(requests + 1):  # the first round warms both up
            for name, client in clients.items():
                prompt = [rng.randrange(10, 8000) for _ in range(n)]
                seconds = await ttft(client, model, prompt)
                if i > 0:
                    times[(name, n)].append(seconds)
    for client in clients.values():
        await client.close()
    return times


def ttft_table(times: dict[tuple[str, int], list[float]], lengths: list[int]) -> str:
    rows = []
    for n in lengths:
        local, disagg = (statistics.median(times[(s, n)]) for s in ("single process", "disaggregated"))
        spread = max(times[("disaggregated", n)]) - min(times[("disaggregated", n)])
        rows.append([n, f"{local * 1e3:.0f}", f"{disagg * 1e3:.0f}", f"{(disagg - local) * 1e3:+.0f}",
                     f"{disagg / local:.2f}x", f"{spread * 1e3:.0f}"])
    headers = ["prompt tokens", "single process TTFT ms", "disaggregated TTFT ms", "added ms",
               "ratio", "disagg. spread ms"]
    return markdown_table(headers, rows)


def run_ttft(args: argparse.Namespace) -> None:
    if args.transfer == "auto":  # what `glmserve serve` picks, named in the output
        args.transfer = "nixl" if nixl_unavailable_reason() is None else "tcp"
    servers = start_servers(args.model, args.transfer)
    try:
        urls = {name: s.url for name, s in servers.items()}

        async def go() -> dict[tuple[str, int], list[float]]:
            for url in urls.values():
                await wait_ready(url, args.model.name)
            return await measure_ttft(urls, args.model.name, args.lengths, args.requests, args.seed)
        times = asyncio.run(go())
    finally:
        for server in servers.values():
            server.stop()
    print(f"\n### (a) Time to first token, median of {args.requests} requests "
          f"(platform KV transfer: {args.transfer})\n")
    print(ttft_table(times, args.lengths))


# --- (b) KV transfer throughput -----------------------------------------------------------------------


def transfer_rate(kind: str, num_blocks: int, block_bytes: int, repeats: int) -> float:
    """Best bytes/s of writing ``num_blocks`` blocks into a receiver process with backend ``kind``."""
    receiver = ReceiverProcess.start(kind, num_blocks, block_bytes)
    writer = make_backend(kind)
    try:
        writer.register(make_source(num_blocks, block_bytes))
        peer = writer.connect(receiver.target_info)
        ids = list(range(num_blocks))
        measure_write_throughput(writer, peer, ids, ids, repeats=1)  # connection set-up, page faults
        return measure_write_throughput(writer, peer, ids, ids, repeats=repeats)
    finally:
        writer.close()
        receiver.stop()


def run_transfer(args: argparse.Namespace) -> None:
    layout = KVLayout.for_config(GlmConfig.from_pretrained(args.model), BLOCK_SIZE, torch.bfloat16)
    real = KVLayout.for_config(GlmConfig.from_dict(GLM52_KV), BLOCK_SIZE, torch.bfloat16)
    kinds = [k for k in args.kinds.split(",") if k]
    if "nixl" in kinds and (why := nixl_unavailable_reason()) is not None:
        print(f"\n(NIXL skipped: {why})")
        kinds.remove("nixl")
    rows = []
    for tokens in args.kv_tokens:
        blocks = math.ceil(tokens / BLOCK_SIZE)
        size = blocks * layout.bytes_per_block
        limit = memcpy_throughput(blocks, layout.bytes_per_block, repeats=args.repeats)
        rows.append([tokens, blocks, f"{size / 2**20:.1f}", "memcpy (torch copy_, 1 process)",
                     f"{limit / GB:.2f}", "1.00", f"{size / limit * 1e3:.1f}"])
        for kind in kinds:
            rate = transfer_rate(kind, blocks, layout.bytes_per_block, args.repeats)
            rows.append([tokens, blocks, f"{size / 2**20:.1f}", f"{kind} (2 processes)", f"{rate / GB:.2f}",
                         f"{rate / limit:.2f}", f"{size / rate * 1e3:.1f}"])
    print(f"\n### (b) KV transfer throughput, best of {args.repeats} writes\n")
    print(f"- KV layout of {args.model.name}: {layout.bytes_per_token:,} B/token stored, "
          f"{layout.bytes_per_block:,} B/block of {BLOCK_SIZE} tokens")
    print(f"- real GLM-5.2 layout: {real.main_bytes_per_token:,} B/token main model, {real.bytes_per_token:,} "
          f"B/token with MTP; a 32K prompt is {32768 * real.bytes_per_token / GB:.2f} GB\n")
    headers = ["prompt tokens", "blocks", "MiB", "path", "GB/s", "vs memcpy", "ms per prompt"]
    print(markdown_table(headers, rows))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the memcpy baseline: one thread, as one transfer is one stream
    command = "python bench/bench_disaggregated.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print_header("Disaggregated serving vs one process", command.strip())
    load, start = load_average(), time.perf_counter()
    if not args.skip_ttft:
        run_ttft(args)
    if not args.skip_transfer:
        run_transfer(args)
    # The work runs in the servers and the receiver: the load average says whether others competed.
    print(f"\n- run: {time.perf_counter() - start:.0f} s wall, load average {load} at start, "
          f"{load_average()} at end")


if __name__ == "__main__":
    main()
