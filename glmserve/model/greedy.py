"""greedy_generate: plain, non-speculative greedy decoding of one sequence over a paged cache; and
greedy_ids, the best id of each row, which every greedy choice (sampler, verification, MTP drafts) takes.

The oracle the engine's batched and speculative decoding are checked against, and what the toy
model's training script uses to evaluate itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The best id of each row along the last dim; ties (and NaN) as ``argmax``: the first one.
    ``max(dim).indices`` is the same and 3x faster than ``argmax(dim)`` on CPU ([32, 8192] float32:
    130 against 400 us, 2% of a decode step)."""
    return logits.max(dim=-1).indices


@torch.inference_mode()
def greedy_generate(
    model: GlmForCausalLM,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    block_size: int = 64,
) -> list[int]:
    """Generated token ids (the stop token included when one ends generation)."""
    total = len(prompt) + max_new_tokens
    layout = KVLayout.for_config(model.config, block_size, dtype=model.dtype, with_mtp=False)
    n_blocks = (total + block_size - 1) // block_size
    cache = PagedKVCache(layout, n_blocks)
    table = [list(range(n_blocks))]
    logits = model.forward_logits(ForwardBatch.build([list(prompt)], [0], table, block_size), cache)
    out: list[int] = []
    length = len(prompt)
    while True:
        token = int(greedy_ids(logits[-1]))
        out.append(token)
        if token in stop_ids or len(out) >= max_new_tokens:
            return out
        logits = model.forward_logits(ForwardBatch.build([[token]], [length], table, block_size), cache)
        length += 1
