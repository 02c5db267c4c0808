"""Transparent huge pages for the KV cache: a long-lived buffer whose rows are read scattered.

A decode step gathers each sequence's selected rows from all over the cache; with 4 KiB pages nearly
every row costs a TLB miss. Advised before its first touch, the buffer is backed by 2 MiB pages where
the kernel allows it (THP in `madvise` or `always` mode): a batch-32 decode step 1.91-1.96x of its
floor against 1.97-2.05x (an AMX Xeon, docs/benchmarks.md). PyTorch's THP_MEM_ALLOC_ENABLE does this
for every tensor of 2 MiB and more, so a step's large temporaries pay huge-page faults each time they
are allocated (a 1,536-token prefill ~4% slower); only buffers that live as long as the engine are
advised here. Advice only: where the kernel refuses it, the buffer stays on small pages.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


def zeros_on_huge_pages(rows: int, cols: int, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """torch.zeros(rows, cols), on huge pages where the device is the CPU of a Linux host."""
    buffer = torch.empty(rows, cols, dtype=dtype, device=device)
    if buffer.device.type == "cpu" and sys.platform.startswith("linux"):
        advise_huge_pages(buffer)
    return buffer.zero_()  # the first touch: the kernel faults the advised range in as huge pages


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB pages inside `t`'s memory; whether the kernel agreed."""
    begin = t.data_ptr()
    start = -(-begin // HUGE_PAGE) * HUGE_PAGE
    length = (begin + t.numel() * t.element_size() - start) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return False
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(start, length, _MADV_HUGEPAGE) == 0
