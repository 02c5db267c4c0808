"""Which dtype the model runs in: bfloat16 only where the CPU has matrix units for it, else float32.

bf16 halves the weights' and the KV cache's memory traffic, but on a CPU without bf16 matrix
instructions every bf16 GEMM converts to fp32 inside, and glmserve's fp32 islands (norms, softmax,
the indexer, the router) add conversions around it: measured slower than float32 end to end, also
with AVX512-BF16 alone (docs/benchmarks.md). AMX tiles do bf16 GEMMs several times faster than fp32
ones, which is where bf16 can pay. `auto` follows that; an explicit dtype always wins.
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FAST_BF16_FLAGS = ("amx_bf16",)


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
    """bfloat16 where the CPU has AMX bf16 tiles, float32 everywhere else."""
    flags = cpu_flags() if flags is None else flags
    return torch.bfloat16 if any(f in flags for f in FAST_BF16_FLAGS) else torch.float32


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """`auto`, `float32` or `bfloat16` (or a torch dtype) -> the torch dtype to load the model in."""
    if isinstance(name, torch.dtype):
        if name not in DTYPE_NAMES.values():
            raise ValueError(f"dtype: {name} is not supported (want float32 or bfloat16)")
        return name
    if name == "auto":
        return auto_dtype()
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype: {name!r} is not 'auto', 'float32' or 'bfloat16'")
    return DTYPE_NAMES[name]
