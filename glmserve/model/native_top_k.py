"""The indexer's top-k as a compiled kernel (csrc/top_k_earliest.cpp), or None where it cannot be built.

The prefill selection's top-k in torch ops (a topk of k + 1, then the rows with ties at the cut picked
again) cost ~10 us a row of 1,500 scores on an AMX Xeon, about a sixth of a 1,536-token prefill; the
kernel selects the same positions in one pass per row, in 0.36x the time (the 68 query tiles of a
1,536-token prefill: 20.7 against 57.7 ms).

It is built on first use by torch's C++ extension loader (a C++ compiler and ninja) and cached under
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so a process loads it in well under a second
after the first build (~25 s). `python -m glmserve.model.native_top_k` builds it ahead of time
(tools/install.sh does). Where it cannot be built the torch ops run, with one warning; the selection is
the same either way. GLMSERVE_NATIVE_TOP_K=0 turns it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "top_k_earliest.cpp"
ENV = "GLMSERVE_NATIVE_TOP_K"

# (scores [R, T] float32, lengths [R] int64, k, ascending) -> [R, k] int64
TopK = Callable[[torch.Tensor, torch.Tensor, int, bool], torch.Tensor]


@cache
def kernel() -> TopK | None:
    """The compiled top_k_earliest, or None (turned off, or no compiler)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load("glmserve_top_k_earliest", [str(SOURCE)], extra_cflags=["-O3"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache: the torch path is the same selection
        log.warning("the native top-k kernel could not be built (%s); the indexer runs torch ops", e)
        return None
    return module.top_k_earliest


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("native top-k:", "built" if kernel() is not None else "not available (the torch path runs)")
