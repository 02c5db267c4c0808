"""glmserve: disaggregated serving for the GLM-5.2 model family."""

import os

# Tensors of 2 MiB and more (weights, the KV cache, a step's larger activations) on transparent huge
# pages: fewer TLB misses and page faults; a batch-32 decode step ~5% nearer its floor on an AMX Xeon
# (docs/benchmarks.md). PyTorch reads this at its first CPU allocation, so it is set on import, before
# any; a value already in the environment wins (THP_MEM_ALLOC_ENABLE=0 turns it off).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
