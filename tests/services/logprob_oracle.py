"""The model's own log-probabilities, for checking the logprobs the services report: one plain
forward pass over prompt + generated tokens (no cache reuse, no speculation), then log_softmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache


@dataclass(frozen=True)
class PositionLogprobs:
    chosen: float  # the generated token's logprob
    top: list[tuple[int, float]]  # the n most likely (id, logprob)


@torch.inference_mode()
def reference_logprobs(model: GlmForCausalLM, prompt: list[int], generated: list[int],
                       n: int) -> list[PositionLogprobs]:
    """Per generated token: its logprob under the model and the ``n`` most likely tokens there."""
    ids = list(prompt) + list(generated)
    block = 64
    blocks = -(-len(ids) // block)
    cache = PagedKVCache(KVLayout.for_config(model.config, block, dtype=model.dtype, with_mtp=False), blocks)
    logits = model.forward_logits(ForwardBatch.build([ids], [0], [list(range(blocks))], block), cache)
    rows = torch.log_softmax(logits[len(prompt) - 1 : len(ids) - 1].float(), dim=-1)
    out = []
    for row, token in zip(rows, generated, strict=True):
        top = row.topk(n) if n else None
        pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
        out.append(PositionLogprobs(float(row[token]), pairs))
    return out
