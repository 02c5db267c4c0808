"""Shared helpers for the benchmarks: setup, timing, peak memory, random models, markdown output.

Every benchmark measures a baseline and the variant in the same process and reports ratios, so the
numbers compare across machines only as ratios, never as absolute times.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from glmserve.model.config import GlmConfig
from glmserve.model.glm_model import GlmForCausalLM, init_random

MiB = 2**20

# A small GLM-5.2-shaped config; benchmarks override what they measure.
BASE_CONFIG: dict[str, Any] = {
    "model_type": "glm_moe_dsa",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "index_topk": 256,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "num_nextn_predict_layers": 0,
    "rope_theta": 10000.0,
}


def setup(threads: int, seed: int) -> None:
    """Fixed thread count and seeds, so two runs on one machine do the same work."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)


def random_config(**overrides: Any) -> GlmConfig:
    """BASE_CONFIG with `overrides`, validated by GlmConfig.from_dict."""
    return GlmConfig.from_dict({**BASE_CONFIG, **overrides})


def random_model(config: GlmConfig, seed: int) -> GlmForCausalLM:
    """A float32 model with init_random weights drawn from `seed` (same seed and shapes: same weights)."""
    model = GlmForCausalLM(config, with_mtp=False)
    init_random(model, generator=torch.Generator().manual_seed(seed))
    return model.eval()


@dataclass(frozen=True)
class Timing:
    samples: tuple[float, ...]  # seconds, one per repeat

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0


def time_interleaved(
    fns: dict[str, Callable[[], Any]], warmup: int = 1, repeats: int = 5, min_sample_s: float = 0.0
) -> dict[str, Timing]:
    """Wall time per call of each variant: `repeats` samples after `warmup` untimed calls (Timing.median).

    The variants alternate within every repeat, so that a slow spell of the machine (another process,
    frequency changes) hits all of them alike and their ratio holds. A variant faster than
    `min_sample_s` (as timed in the warm-up) is called several times per sample, and the sample is
    the mean of those calls, so one scheduler hiccup does not decide a millisecond-scale median.
    """
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    calls = dict.fromkeys(fns, 1)
    for i in range(warmup):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i == warmup - 1:
                calls[name] = max(1, math.ceil(min_sample_s / max(time.perf_counter() - start, 1e-6)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / calls[name])
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def peak_alloc_bytes(fn: Callable[[], Any]) -> int | None:
    """Peak bytes allocated on the CPU allocator during `fn()`, above what was live when it started.

    Replays every allocation and free that torch.profiler (profile_memory=True) records, in time
    order, and takes the maximum of the running sum: this is the high-water mark of tensors the call
    itself created (temporaries included), independent of what the C allocator keeps cached, which a
    peak-RSS delta would not be. Uses the profiler's event tree (a private but stable API); returns
    None where it is unavailable.
    """
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        roots = prof.profiler.kineto_results.experimental_event_tree()
    except AttributeError:
        return None
    allocs: list[tuple[int, int]] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and "cpu" in str(node.extra_fields.device):
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(allocs):
        live += size
        peak = max(peak, live)
    return peak


def machine_info() -> str:
    """One line: CPU count and model, RAM, torch version and threads."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = "unknown RAM"
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        ram = f"{kib / 2**20:.1f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return (
        f"{os.cpu_count()} CPUs (nproc), {cpu}, {ram}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )


def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


class RunMonitor:
    """How much of the machine a run got: load average at start and end, and CPU time used / (wall time
    x threads). On an idle machine the share is near 100% for matmul-bound work; far below it (or a
    load average above the core count) means another process competed and the absolute times are inflated."""

    def __init__(self) -> None:
        self.load_start = load_average()
        self.wall_start = time.perf_counter()
        self.cpu_start = time.process_time()

    def summary(self) -> str:
        wall = time.perf_counter() - self.wall_start
        share = (time.process_time() - self.cpu_start) / (wall * torch.get_num_threads())
        return (
            f"{wall:.0f} s wall, CPU share {share:.0%} of {torch.get_num_threads()} threads, "
            f"load average {self.load_start} at start, {load_average()} at end"
        )


def print_header(title: str, command: str, monitor: RunMonitor | None = None) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"## {title}\n")
    print(f"- command: `{command}`")
    print(f"- date: {now}")
    print(f"- machine: {machine_info()}")
    if monitor is not None:
        print(f"- run: {monitor.summary()}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    """A command-line list of integers: "64,512,1536"."""
    return [int(v) for v in text.split(",") if v]


def rotated(items: list, shift: int) -> list:
    """`items` starting at position `shift` (mod len): round r of an interleaved benchmark runs the
    systems in this order, so each takes every place (the first run after a long one differs)."""
    shift %= len(items)
    return items[shift:] + items[:shift]
