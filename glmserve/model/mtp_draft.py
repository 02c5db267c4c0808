"""Greedy multi-step drafting with the MTP layer over the paged cache.

Step 1 at position t takes the main model's normed hidden state h_t and the token x_{t+1}; step j
takes step j-1's output hidden state and draft token at position t+j-1. With
`index_share_for_mtp_iteration`, steps after the first skip the MTP indexer and reuse step 1's top-k,
extended by the positions drafted since (a query always sees the tokens drafted before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.greedy import greedy_ids
from glmserve.model.paged_cache import PagedKVCache


@dataclass(frozen=True)
class DraftSeed:
    hidden: torch.Tensor  # [hidden] main model's normed hidden state at `position`
    next_token: int  # the token at position + 1 (already decided)
    position: int
    block_table: list[int]  # must cover position + steps tokens


@torch.inference_mode()
def draft_tokens(
    model: GlmForCausalLM, cache: PagedKVCache, seeds: list[DraftSeed], steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft `steps` tokens per sequence. Returns (draft ids [B, steps], draft logits [B, steps, vocab])."""
    share = model.config.index_share_for_mtp_iteration
    block_size = cache.layout.block_size
    tables = [s.block_table for s in seeds]
    hidden = torch.stack([s.hidden for s in seeds])
    tokens = [s.next_token for s in seeds]
    first_topk: list[torch.Tensor] | None = None
    ids, logits = [], []
    for j in range(steps):
        positions = [s.position + j for s in seeds]
        batch = ForwardBatch.build([[t] for t in tokens], positions, tables, block_size)
        topk_in = None
        if share and first_topk is not None:
            topk_in = [extend_shared_topk(k, s.position, j) for k, s in zip(first_topk, seeds, strict=True)]
        hidden, topk = model.mtp_step(model.context(batch, cache), hidden, topk_in)
        if first_topk is None:
            first_topk = topk
        step_logits = model.mtp_logits(hidden)
        tokens = greedy_ids(step_logits).tolist()
        ids.append(torch.tensor(tokens))
        logits.append(step_logits)
    return torch.stack(ids, dim=1), torch.stack(logits, dim=1)


def extend_shared_topk(topk: torch.Tensor, position: int, step: int) -> torch.Tensor:
    """Step 1's selection [1, k] plus the positions drafted after it, for the query at position+step."""
    drafted = torch.arange(position + 1, position + step + 1, dtype=topk.dtype).unsqueeze(0)
    return torch.cat([topk, drafted], dim=1)
