"""Host KV tier: time to first token of a long prompt, cold vs device-tier hit vs host-tier hit.

Real processes on 127.0.0.1, as `glmserve serve` runs them: a kvstore with a host tier, one prefill
and one decode worker attached to it (each with OMP_NUM_THREADS=1, `--transfer` as given). TTFT is
measured at the decode worker's gRPC Generate (the router adds the same work to every case): call
to the first event carrying a token, which includes prefill and the KV transfer to decode.

Per repeat, with a prompt no earlier repeat shares a block with (its first token differs):
1. cold: nothing cached anywhere;
2. device hit: the same prompt again (the prefill worker's block pool has it);
3. host hit: the prefill worker is restarted (its device tier is empty; the host tier kept the blocks
   both workers wrote through), warmed up with an unrelated short prompt, then the same prompt:
   the blocks are loaded back from the host tier before prefill.
Before each timed request, write-through of the previous one is allowed to settle. Medians over
`--repeats`; ratios are against cold in the same run.

    python bench/bench_host_tier.py [--tokens 16384 --repeats 2 --transfer auto]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import markdown_table, print_header  # noqa: E402
from glmserve.commands.free_ports import PortPicker  # noqa: E402
from glmserve.core.block_hash import reusable_blocks  # noqa: E402
from glmserve.core.generation import SamplingParams  # noqa: E402
from glmserve.model.config import GlmConfig  # noqa: E402
from glmserve.model.kv_layout import KVLayout  # noqa: E402
from glmserve.proto_gen.glmserve.common.v1 import generation_pb2 as common_pb  # noqa: E402
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as decode_pb  # noqa: E402
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc  # noqa: E402
from glmserve.services.generation_proto import sampling_to_proto  # noqa: E402
from glmserve.text.tokenizer import Tokenizer  # noqa: E402
from tools.tiny_corpus import stdlib_texts  # noqa: E402

FIRST_TOKENS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
BLOCK = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/glm52-tiny")
    p.add_argument("--tokens", type=int, default=16384, help="prompt length")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--transfer", choices=("auto", "nixl", "tcp"), default="auto")
    return p.parse_args(argv)


free_port = PortPicker("127.0.0.1").port  # below the ephemeral range: no client socket takes it first


class Proc:
    """One service process; ``ready`` waits for READY (workers) or a metrics endpoint (kvstore)."""

    def __init__(self, name: str, args: list[str], logs: Path) -> None:
        self.name, self.metrics_port = name, free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN", "OMP_NUM_THREADS": "1"}
        self.log = logs / f"{name}-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", *args, "--metrics-port", str(self.metrics_port)],
                                         stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO)
        self.address = ""

    def ready(self, timeout_s: float = 300.0) -> Proc:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not self.address:
                if time.monotonic() > deadline or not sel.select(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"{self.name} not ready:\n{self.log.read_text()}")
                line = self.proc.stdout.readline().decode()
                if not line:
                    raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()}")
                if line.startswith("READY "):
                    self.address = line.split()[1]
        return self

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return 0.0
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Cluster:
    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        config = GlmConfig.from_pretrained(args.model)
        layout = KVLayout.for_config(config, BLOCK, dtype=torch.float32, with_mtp=config.num_nextn_predict_layers > 0)
        prompt_bytes = (args.tokens // BLOCK + 2) * layout.bytes_per_block
        self.args, self.logs = args, logs
        self.kv_port = free_port()
        self.kvstore = Proc("kvstore", ["glmserve.services.kvstore.main", "--host", "127.0.0.1", "--port",
                                        str(self.kv_port), "--host-tier-bytes", str(3 * prompt_bytes),
                                        "--transfer", args.transfer], logs)
        self.worker_args = ["--model", args.model, "--host", "127.0.0.1", "--port", "0", "--transfer", args.transfer,
                            "--kv-cache-bytes", str(2 * prompt_bytes), "--kvstore", f"127.0.0.1:{self.kv_port}"]
        self.decode = self._worker("decode")
        self.prefill = self._worker("prefill")
        self.decode.ready(), self.prefill.ready()

    def _worker(self, role: str) -> Proc:
        # A cold 16K-token prefill on one CPU thread takes minutes: past decode's default deadline.
        extra = ["--prefill-timeout-s", "1800"] if role == "decode" else []
        return Proc(role, [f"glmserve.services.{role}.main", "--worker-id", role, *self.worker_args, *extra],
                    self.logs)

    def restart_prefill(self) -> None:
        self.prefill.stop()
        self.prefill = self._worker("prefill").ready()

    def settle(self, timeout_s: float = 120.0) -> None:
        """Wait until both workers are idle and the host tier stopped growing (write-through done)."""
        deadline, last = time.monotonic() + timeout_s, -1.0
        while time.monotonic() < deadline:
            used = self.prefill.metric("glmserve_kv_blocks_used") + self.decode.metric("glmserve_kv_blocks_used")
            blocks = self.kvstore.metric("glmserve_host_tier_blocks")
            if used == 0 and blocks == last:
                return
            last = blocks
            time.sleep(0.5)

    def ttft(self, rid: str, prompt: list[int]) -> tuple[float, int]:
        """(seconds to the first token, cached tokens reported)."""

        async def go() -> tuple[float, int]:
            async with grpc.aio.insecure_channel(self.decode.address) as channel:
                request = decode_pb.GenerateRequest(
                    transfer=common_pb.TransferId(request_id=rid, generation=1), prompt_ids=prompt,
                    sampling=sampling_to_proto(FIRST_TOKENS), prefill_target=self.prefill.address)
                start, first, cached = time.perf_counter(), None, 0
                async for event in decode_grpc.DecodeStub(channel).Generate(request, timeout=1800):
                    if event.token_ids and first is None:
                        first = time.perf_counter() - start
                    if event.finish_reason:  # the last event
                        if event.error:
                            raise RuntimeError(f"{rid}: {event.error}")
                        cached = event.num_cached_tokens
                assert first is not None
                return first, cached

        return asyncio.run(go())

    def stop(self) -> None:
        for p in (self.decode, self.prefill, self.kvstore):
            p.stop()


def source_tokens(model: str, n: int) -> list[int]:
    tokenizer = Tokenizer.from_dir(model)
    ids: list[int] = []
    for text in stdlib_texts("heldout"):
        ids += tokenizer.encode(text)
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"--tokens: held-out source has only {len(ids)} tokens")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    source = source_tokens(args.model, args.tokens + 64)
    warmup = source[args.tokens:][::-1]
    samples: dict[str, list[float]] = {"cold": [], "device": [], "host": []}
    cached: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-host-tier-") as tmp:
        cluster = Cluster(args, Path(tmp))
        try:
            cluster.ttft("warmup", warmup)
            for r in range(args.repeats):
                prompt = [10 + r] + source[1: args.tokens]  # a new first token: no block shared with earlier repeats
                for case in ("cold", "device", "host"):
                    cluster.settle()
                    if case == "host":
                        cluster.restart_prefill()
                        cluster.ttft(f"warmup-{r}", warmup)
                        cluster.settle()
                    seconds, cached[case] = cluster.ttft(f"{case}-{r}", prompt)
                    samples[case].append(seconds)
                    print(f"repeat {r} {case}: {seconds:.3f} s, {cached[case]} cached tokens", file=sys.stderr)
            loads = cluster.prefill.metric("glmserve_host_tier_loadback_seconds_sum")
            load_bytes = cluster.prefill.metric("glmserve_host_tier_loadback_bytes_total")
            transfer = "nixl" if "nixl" in cluster.prefill.log.read_text() else "tcp"
        finally:
            cluster.stop()
    cold = statistics.median(samples["cold"])
    rows = [[case, f"{statistics.median(s) * 1e3:.0f}", f"{cold / statistics.median(s):.2f}", cached[case],
             args.tokens - cached[case]] for case, s in samples.items()]
    command = " ".join(["python", f"bench/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)])
    print_header("Host KV tier: time to first token, cold vs device hit vs host hit", command)
    print(f"- model: `{args.model}` (float32); {args.tokens}-token prompt of held-out stdlib source "
          f"({reusable_blocks(args.tokens, BLOCK)} reusable blocks of {BLOCK}); kvstore, prefill and decode "
          f"as processes (OMP_NUM_THREADS=1 each), {transfer} transfer; TTFT at decode's Generate; "
          f"median of {args.repeats} repeats\n")
    print(markdown_table(["case", "TTFT ms", "speed-up vs cold", "cached tokens", "tokens computed"], rows))
    print(f"\nLoad-back in the last repeat: {load_bytes / 2**20:.1f} MiB in {loads * 1e3:.0f} ms "
          f"(host tier -> prefill worker's blocks, incl. lookup).")


if __name__ == "__main__":
    main()
