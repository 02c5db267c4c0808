"""Prefill and decode worker processes on 127.0.0.1 for tests, and a small async gRPC client.

``WorkerProcess.launch(role, transfer, log)`` starts ``python -m glmserve.services.<role>.main``
with the bundled model on a free port; ``ready()`` waits for its ``READY host:port`` line.
``stop()`` sends SIGTERM (and checks the exit status), ``kill()`` is kill -9.
(The router as a process: router_process.RouterProcess.)
"""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from glmserve.core.generation import SamplingParams
from glmserve.proto_gen.glmserve.common.v1 import generation_pb2 as common_pb
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2 as decode_pb
from glmserve.proto_gen.glmserve.decode.v1 import decode_pb2_grpc as decode_grpc
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2 as prefill_pb
from glmserve.proto_gen.glmserve.prefill.v1 import prefill_pb2_grpc as prefill_grpc
from glmserve.services.generation_proto import sampling_to_proto
from glmserve.services.metrics_exposition import SERVICE_LABELS
from tests.shared import HAS_MODEL, MODEL_DIR, REPO, free_port  # noqa: F401 - re-exported to the tests

KV_CACHE_BYTES = 48 << 20  # ~130 blocks of 64 tokens with the bundled model: small pools, fast starts


MetricSamples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric_samples(text: str) -> MetricSamples:
    """Every sample of a /metrics page: (name, sorted labels but the service's own) -> value."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in SERVICE_LABELS))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def spawn_service(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A service process of this checkout: stdout piped (for its READY line), stderr to `log`."""
    # This checkout's code, whatever an installed glmserve points at.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    # One torch thread per process: the CI machine has 2 cores and runs two or three workers.
    env = {**os.environ, "PYTHONPATH": path, "NIXL_LOG_LEVEL": "WARN", "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as err:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=REPO)


def read_ready_address(proc: subprocess.Popen[bytes], log: Path, name: str, timeout_s: float) -> str:
    """The address of the ``READY <address>`` line the service prints once it serves; a service that
    prints none in time is killed, and the error carries its log."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            if time.monotonic() > deadline or not sel.select(max(0.0, deadline - time.monotonic())):
                proc.kill()
                proc.wait()
                raise RuntimeError(f"{name} not ready in {timeout_s}s:\n{log.read_text()}")
            line = proc.stdout.readline().decode()
            if not line:
                raise RuntimeError(f"{name} exited:\n{log.read_text()}")
            if line.startswith("READY "):
                return line.split()[1]


class WorkerProcess:
    def __init__(self, role: str, proc: subprocess.Popen[bytes], log: Path, metrics_port: int) -> None:
        self.role, self.proc, self.log, self.metrics_port = role, proc, log, metrics_port
        self.address: str | None = None

    @classmethod
    def launch(cls, role: str, transfer: str, log: Path, *extra: str,
               kv_cache_bytes: int = KV_CACHE_BYTES) -> WorkerProcess:
        cmd = [sys.executable, "-m", f"glmserve.services.{role}.main", "--model", str(MODEL_DIR),
               "--host", "127.0.0.1", "--port", "0", "--worker-id", f"{role}-{log.stem}",
               "--transfer", transfer, "--kv-cache-bytes", str(kv_cache_bytes),
               "--metrics-port", str(metrics_port := free_port()), *extra]
        return cls(role, spawn_service(cmd, log), log, metrics_port)

    def ready(self, timeout_s: float = 90.0) -> WorkerProcess:
        """Wait for the ``READY host:port`` line."""
        if self.address is None:
            self.address = read_ready_address(self.proc, self.log, self.role, timeout_s)
        return self

    def cpu_seconds(self) -> float:
        """User + system CPU time the process used so far (from /proc/<pid>/stat)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def health(self) -> object:
        stub_cls = decode_grpc.DecodeStub if self.role == "decode" else prefill_grpc.PrefillStub
        request = decode_pb.HealthRequest() if self.role == "decode" else prefill_pb.HealthRequest()
        with grpc.insecure_channel(self.address) as channel:
            return stub_cls(channel).Health(request, timeout=5)

    def metrics(self) -> MetricSamples:
        """Every sample of the worker's /metrics: (name, sorted labels) -> value."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return metric_samples(r.read().decode())

    def wait_free(self, free_blocks: int, timeout_s: float = 15.0) -> object:
        """Poll Health until ``free_blocks`` are free again and nothing runs; the last reply."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if (h.free_blocks == free_blocks and h.running == 0 and h.waiting == 0) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@dataclass
class Outcome:
    """What one Generate stream produced. A call ended with ABORTED (the request failed before any
    token for a reason of its path, e.g. its prefill worker died: the router tries again) reads as
    finish_reason "error" with the status's details, and ``retryable``."""

    tokens: list[int] = field(default_factory=list)
    events: list[decode_pb.GenerateEvent] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""
    num_cached_tokens: int = 0
    cancelled: bool = False
    retryable: bool = False


def generate_request(request_id: str, prompt: Sequence[int], params: SamplingParams, prefill: str,
                     generation: int = 1, local: bool = False) -> decode_pb.GenerateRequest:
    """``local``: the decode worker prefills the prompt itself (the router's local prefill)."""
    return decode_pb.GenerateRequest(
        transfer=common_pb.TransferId(request_id=request_id, generation=generation),
        prompt_ids=list(prompt), sampling=sampling_to_proto(params), prefill_target=prefill,
        prefill_locally=local,
    )


async def generate(stub: decode_grpc.DecodeStub, request: decode_pb.GenerateRequest,
                   cancel_after_s: float | None = None, cancel_after_events: int | None = None) -> Outcome:
    """Run one Generate; cancel it after ``cancel_after_s`` seconds or that many events."""
    out = Outcome()
    call = stub.Generate(request, timeout=120)

    async def read() -> None:
        async for event in call:
            out.events.append(event)
            out.tokens.extend(event.token_ids)
            if event.finish_reason:  # the last event
                out.finish_reason, out.error = event.finish_reason, event.error
                out.num_cached_tokens = event.num_cached_tokens
            if cancel_after_events is not None and len(out.events) >= cancel_after_events:
                call.cancel()
                out.cancelled = True
                return

    try:
        await asyncio.wait_for(read(), cancel_after_s) if cancel_after_s is not None else await read()
    except TimeoutError:
        call.cancel()
        out.cancelled = True
    except asyncio.CancelledError:
        if not out.cancelled:
            raise
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.ABORTED or out.events:
            raise
        out.finish_reason, out.error, out.retryable = "error", e.details() or "", True
    return out


def greedy_oracle(max_tokens: int) -> Callable[[list[int]], list[int]]:
    """Plain greedy decoding of the model in this process (cached per prompt): the reference every
    served output must equal. ``.model`` is the loaded model (for logprob references)."""
    from glmserve.model.greedy import greedy_generate
    from glmserve.model.loader import load_model

    model = load_model(MODEL_DIR)
    cache: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = greedy_generate(model, prompt, max_tokens, stop_ids=model.config.eos_token_ids)
        return cache[tuple(prompt)]

    run.model = model  # type: ignore[attr-defined]
    return run
