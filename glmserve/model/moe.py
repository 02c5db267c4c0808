"""Mixture of experts: sigmoid router with correction bias, routed experts grouped by expert, shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmserve.model.config import GlmConfig
from glmserve.model.mlp import GatedMLP, silu_mul
from glmserve.model.row_linear import row_linear

# Rows per expert up to which all experts run as one padded batched matmul, while the padded batch
# (every expert padded to the busiest one's rows, idle ones included) stays within PAD_LIMIT times
# max(rows, experts); beyond, each expert runs alone (the padding would cost more than the ops).
BATCHED_MAX_ROWS = 64
PAD_LIMIT = 4
# Up to this many tokens, while there are at most DENSE_MAX_RATIO x num_experts_per_tok experts, every
# token runs through every expert and the outputs are weighted by the router (0 for experts a token did
# not choose): no sort, count or scatter by expert and no sync to Python, ~8 ops instead of ~20, for at
# most DENSE_MAX_RATIO x the routed FLOPs. Decode and verification steps of small models, where a step
# is per-op overhead; GLM-5 sizes (256 experts, top-8) never take it.
DENSE_MAX_TOKENS = 64
DENSE_MAX_RATIO = 4
# oneDNN builds a kernel for every new row count of a bfloat16 product (~1.5 ms each on an AMX Xeon,
# 25x a 300-row expert's product) and experts' row counts change with every chunk; in bfloat16 each
# expert runs on its rows rounded up to a multiple of this (the next expert's rows, or zeros after the
# last; their outputs are dropped), so the counts repeat and the kernels are cached.
BF16_ROW_BUCKET = 32


class TopkRouter(nn.Module):
    """Chooses `num_experts_per_tok` experts per token.

    The bias only steers the choice; the weights come from the plain sigmoid scores. With `n_group` > 1
    only experts in the `topk_group` best groups (by the sum of each group's two best scores) compete.
    """

    def __init__(self, config: GlmConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (router logits [N, E], weights [N, k], expert ids [N, k])."""
        c = self.config
        logits = row_linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if c.n_group > 1:
            choice = self._limit_to_best_groups(choice)
        expert_ids = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * c.routed_scaling_factor, expert_ids

    def _limit_to_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        c = self.config
        grouped = choice.view(-1, c.n_group, c.n_routed_experts // c.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(c.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, c.n_routed_experts)


class RoutedExperts(nn.Module):
    """All routed experts' weights as 3-D tensors; tokens are sorted by expert and run per expert."""

    def __init__(self, config: GlmConfig):
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        k = expert_ids.shape[1]
        if x.shape[0] <= DENSE_MAX_TOKENS and self.gate_up_proj.shape[0] <= DENSE_MAX_RATIO * k:
            return self._dense(x, weights, expert_ids)
        flat_experts = expert_ids.reshape(-1)
        order = flat_experts.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.shape[0])
        # Token rows are gathered, weighted and scattered back once for all experts.
        xs = x.index_select(0, token_of)
        sizes = counts.tolist()
        e, width = len(sizes), max(sizes)
        if width <= BATCHED_MAX_ROWS and e * width <= PAD_LIMIT * max(xs.shape[0], e):
            ys = self._batched(xs, counts, width, flat_experts[order])
        else:
            ys = self._per_expert(xs, sizes)
        # Weighted in fp32 (the weights' dtype), then rounded: ys.float() first, as a mixed bf16 x fp32
        # product computes it but 1.5x faster on CPU (the mixed op does not vectorise).
        y = ys.float().mul_(weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Every token through every expert, weighted by the router. Each token's weighted expert outputs
        are rounded to x's dtype before they are summed, as the grouped paths round them."""
        routing = torch.zeros(x.shape[0], self.gate_up_proj.shape[0], dtype=weights.dtype)
        routing.scatter_(1, expert_ids, weights)  # [N, E], fp32
        gate, up = torch.matmul(x.unsqueeze(0), self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I]
        out = torch.matmul(silu_mul(gate, up), self.down_proj.transpose(1, 2))  # [E, N, hidden]
        return (out * routing.t().unsqueeze(-1)).to(x.dtype).sum(dim=0)

    def _per_expert(self, xs: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Rows sorted by expert, each expert's two matmuls on its own rows (rounded up in bfloat16)."""
        bucket = BF16_ROW_BUCKET if xs.dtype == torch.bfloat16 else 1
        xs = torch.cat([xs, xs.new_zeros(bucket - 1, xs.shape[1])]) if bucket > 1 else xs
        ys, start = [], 0
        for expert, count in enumerate(sizes):
            if count == 0:
                continue
            rows = -(-count // bucket) * bucket
            gate, up = F.linear(xs[start : start + rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            ys.append(F.linear(silu_mul(gate, up), self.down_proj[expert])[:count])
            start += count
        return torch.cat(ys)

    def _batched(self, xs: torch.Tensor, counts: torch.Tensor, width: int, sorted_experts: torch.Tensor):
        """The same with every expert in one batched matmul, each padded to `width` rows (idle ones
        are all padding): on decode batches (few rows per expert) ~10 ops instead of ~6 per expert."""
        e, h = self.gate_up_proj.shape[0], xs.shape[1]
        firsts = counts.cumsum(0) - counts
        slot = sorted_experts * width + torch.arange(xs.shape[0]) - firsts[sorted_experts]
        padded = xs.new_zeros(e * width, h).index_copy_(0, slot, xs).view(e, width, h)
        gate, up = torch.bmm(padded, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        out = torch.bmm(silu_mul(gate, up), self.down_proj.transpose(1, 2))
        return out.view(e * width, h).index_select(0, slot)


class MoE(nn.Module):
    def __init__(self, config: GlmConfig):
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = RoutedExperts(config)
        self.shared_experts = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, expert_ids = self.gate(x)
        return self.experts(x, weights, expert_ids) + self.shared_experts(x)
