"""The compiled kernels (csrc/*.cpp), or None where they cannot be built; the torch ops run then.

Each kernel replaces a chain of small torch ops whose cost is in passes over memory and per-op dispatch,
not arithmetic (numbers from an AMX Xeon, one thread):

- `top_k_earliest` (csrc/top_k_earliest.cpp): the indexer's selection, one pass per row instead of a
  topk of k + 1 and a fix-up of the rows tied at the cut; the same positions, in 0.36x the time (the
  68 query tiles of a 1,536-token prefill: 20.7 against 57.7 ms);
- `rms_norm` (csrc/rms_norm.cpp): GLM's RMSNorm in one pass per row instead of six to eight ops;
- `rope` (csrc/rope.cpp): the interleaved rotation in one pass instead of ten ops, the same bits;
- `paged_index_scores` (csrc/paged_index_scores.cpp): the decode indexer's scores, read through the block
  tables, instead of a gathered copy of the keys, their conversion, two products and a mask;
- `paged_latent_attention` (csrc/paged_latent_attention.cpp): decode and verification attention over each
  query's selected latent rows, read in place, instead of a gathered copy of the rows, two batched
  products, a mask and a softmax (32 queries over 128 rows: 0.64x the time; a batch-32 decode step ~0.9x,
  AVX2 EPYC, float32);
- `bf16_weight_linear` (csrc/bf16_weight_linear.cpp): PackedLinear's float32 products over weights a
  bfloat16 checkpoint gave, read as bfloat16 (half the bytes; 0.58x oneDNN's time at 8 rows, cold).

`rms_norm` takes float32 rows too: one pass instead of six ops (4 against 25 us at [32, 256]).

`python bench/bench_native_kernels.py` measures each against the torch ops, and a prefill and a
decode step with them and without.

They are built on first use by torch's C++ extension loader (a C++ compiler and ninja) and cached under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so a process loads them in well under a second
after the first build (~30 s). `python -m glmserve.model.native_kernels` builds them ahead of time
(tools/install.sh and the Dockerfile do). GLMSERVE_NATIVE_KERNELS=0 turns them off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.cpp"))
ENV = "GLMSERVE_NATIVE_KERNELS"


@cache
def get() -> ModuleType | None:
    """The compiled module, or None (turned off, or no compiler)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(_name(), [str(p) for p in SOURCES], extra_cflags=_flags(), verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache: the torch ops compute the same
        log.warning("the native kernels could not be built (%s); torch ops run instead", e)
        return None


def for_tensors(*tensors: torch.Tensor) -> ModuleType | None:
    """The compiled module where a kernel may take these tensors, else None: they must be in CPU memory
    (the kernels read it directly) and outside autograd (the kernels have no backward)."""
    grad = torch.is_grad_enabled()
    for t in tensors:  # a plain loop: this runs ~60 times in a decode step
        if not t.is_cpu or (grad and t.requires_grad):
            return None
    return get()


def _name() -> str:
    """One build per checkout: two checkouts on one machine sharing a name would rebuild it in turn."""
    return f"glmserve_native_{hashlib.sha1(str(SOURCES[0].parent).encode()).hexdigest()[:10]}"


def _flags() -> list[str]:
    # AVX2 and FMA (every x86-64 server since 2013) let the compiler vectorise the loops; elsewhere
    # (ARM) the compiler's defaults.
    # No contraction of a * b - c * d into a fused multiply-add: the kernels round as torch's ops do.
    exact = ["-O3", "-ffp-contract=off"]
    return exact + ["-march=x86-64-v3"] if platform.machine() in ("x86_64", "AMD64") else exact


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("native kernels:", "built" if get() is not None else "not available (torch ops run instead)")
