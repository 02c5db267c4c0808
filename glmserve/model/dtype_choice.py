"""Which dtype the model runs in: bfloat16 where the CPU has bf16 dot-product instructions, else float32.

bf16 halves the weights' and the KV cache's memory traffic, but on a CPU without bf16 instructions
every bf16 GEMM converts to fp32 inside, and glmserve's fp32 islands (norms, softmax, the indexer,
the router) add conversions around it: slower than float32 there. AMX tiles and AVX512-BF16
(`vdpbf16ps`) do bf16 GEMMs at twice fp32's rate or more; with AVX512-BF16 the engine measured
a 2,048-token prefill 1.6x and a batch-32 decode step 1.2x faster in bf16 than in float32
(`bench/bench_dtype.py`; docs/benchmarks.md, "An AVX512 machine with AVX512-BF16"). `auto`
follows that, unless the environment sets `GLMSERVE_DTYPE` (float32 or bfloat16: the dtype `auto`
means in this process and the processes it starts; the test suite pins float32, the dtype of its
oracles, on every CPU). An explicit dtype always wins. The flags' names: `glmserve.core.dtype_names`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
AUTO_OVERRIDE = "GLMSERVE_DTYPE"  # environment variable: what `auto` resolves to, where set
FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def auto_dtype(flags: frozenset[str] | None = None) -> torch.dtype:
    """bfloat16 where the CPU has AMX bf16 tiles or AVX512-BF16, float32 everywhere else."""
    flags = cpu_flags() if flags is None else flags
    return torch.bfloat16 if any(f in flags for f in FAST_BF16_FLAGS) else torch.float32


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """`auto`, `float32` or `bfloat16` (or a torch dtype) -> the torch dtype to load the model in."""
    if isinstance(name, torch.dtype):
        if name not in DTYPE_NAMES.values():
            raise ValueError(f"dtype: {name} is not supported (want float32 or bfloat16)")
        return name
    if name == "auto":
        pinned = os.environ.get(AUTO_OVERRIDE)
        if pinned and pinned != "auto":
            if pinned not in DTYPE_NAMES:
                raise ValueError(f"{AUTO_OVERRIDE}: {pinned!r} is not 'float32' or 'bfloat16'")
            return DTYPE_NAMES[pinned]
        return auto_dtype()
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype: {name!r} is not 'auto', 'float32' or 'bfloat16'")
    return DTYPE_NAMES[name]
