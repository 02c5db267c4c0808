"""Lossless verification of speculative drafts (Leviathan et al. 2023; Chen et al. 2023).

A step proposes k draft tokens x_1..x_k per request and runs the target model once over them,
giving target logits for k + 1 positions (position i predicts the token after draft i, position 0
the token after the pending one). Each request then emits its accepted drafts plus exactly one
more token, so a step always makes progress (1..k+1 tokens).

Greedy rows: draft i is accepted while it equals the target argmax at position i; the extra token
is the target argmax at the first mismatch (or at position k). The output is therefore exactly
what non-speculative greedy decoding would produce.

Sampled rows, with p = processed target probs and q = processed draft probs (the distribution each
draft token was actually drawn from, after the same temperature/top-k/top-p processing):
accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on the first rejection emit a token from
normalize(max(p_i - q_i, 0)) (p_i if that is all zero, which only rounding can cause); if all k are
accepted emit a bonus token from p_k. Every emitted token then has exactly the target distribution.
``draft_probs=None`` means a deterministic draft (e.g. greedy MTP): q is one-hot on the draft token,
which is still lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from glmserve.core.generation import SamplingParams
from glmserve.engine.sampler import Generators, processed_probs, sample_from_probs, uniform
from glmserve.model.greedy import greedy_ids


@dataclass(frozen=True)
class VerifyOutput:
    """``accepted[b]``: the accepted draft tokens of row b followed by exactly one more token (the
    correction or bonus token); ``num_accepted_drafts`` [B] int64 on the CPU: drafts accepted per row
    (``len(accepted[b]) - 1``)."""

    accepted: list[list[int]]
    num_accepted_drafts: torch.Tensor


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Generators | None = None,
) -> VerifyOutput:
    """Verify ``draft_tokens`` [B, k] (k >= 0) against ``target_logits`` [B, k+1, V].

    ``draft_probs`` [B, k, V] (processed, as returned by ``processed_probs``) or None for
    deterministic drafts; ignored for greedy rows. Row b draws its random numbers from
    ``generators[b]`` (None: the default generator): k uniforms, then one token's noise."""
    batch, k = draft_tokens.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (batch, k + 1):
        raise ValueError(f"target_logits: expected [{batch}, {k + 1}, V], got {tuple(target_logits.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, target_logits.shape[2]):
        raise ValueError(f"draft_probs: expected [{batch}, {k}, V], got {tuple(draft_probs.shape)}")
    if len(params) != batch:
        raise ValueError(f"params: {len(params)} for a batch of {batch}")
    generators = [None] * batch if generators is None else list(generators)
    if len(generators) != batch:
        raise ValueError(f"generators: {len(generators)} for a batch of {batch}")

    draft_tokens = draft_tokens.to(target_logits.device, torch.long)
    num_accepted = [0] * batch
    extra = [0] * batch
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    # All rows greedy (the common case) needs no copy of the batch's logits.
    whole = len(greedy) == batch
    results = [
        (greedy, _verify_greedy(draft_tokens if whole else draft_tokens[greedy],
                                target_logits if whole else target_logits[greedy])),
        (sampled, _verify_sampled(draft_tokens, draft_probs, target_logits, params, generators, sampled)),
    ]
    for rows, (counts, tokens) in results:
        for j, i in enumerate(rows):
            num_accepted[i], extra[i] = counts[j], tokens[j]

    drafts = draft_tokens.tolist()
    accepted = [drafts[i][: num_accepted[i]] + [extra[i]] for i in range(batch)]
    return VerifyOutput(accepted, torch.tensor(num_accepted, dtype=torch.long))


def _verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """(accepted count, extra token) per row: accept while draft == target argmax."""
    if drafts.shape[0] == 0:
        return [], []
    best = greedy_ids(target_logits)  # [b, k+1]; ties -> lowest id, like the Sampler
    n = _leading_true(drafts == best[:, :-1])
    extra = best.gather(1, n.unsqueeze(1)).squeeze(1)
    return n.tolist(), extra.tolist()


def _verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Generators,
    rows: list[int],
) -> tuple[list[int], list[int]]:
    if not rows:
        return [], []
    drafts = draft_tokens[rows]
    b, k = drafts.shape
    gens = [generators[i] for i in rows]
    p = processed_probs(target_logits[rows], [params[i] for i in rows])  # [b, k+1, V]
    p_x = p[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)
    q = None if draft_probs is None else draft_probs[rows].to(p.device, torch.float32)
    q_x = torch.ones_like(p_x) if q is None else q.gather(2, drafts.unsqueeze(2)).squeeze(2)
    # u < p/q written without the division; p_x == 0 always rejects, since u * q_x >= 0.
    accept = uniform(b, k, gens, p.device) * q_x < p_x
    n = _leading_true(accept)

    arange = torch.arange(b, device=p.device)
    p_n = p[arange, n]  # target distribution where the extra token goes
    # q at the rejected position; zero for rows that accepted all k (bonus token from p_k).
    q_n = torch.zeros_like(p_n)
    rejected = (n < k).nonzero().squeeze(1)
    if rejected.numel():
        at = n[rejected]
        if q is None:
            q_n[rejected, drafts[rejected, at]] = 1.0
        else:
            q_n[rejected] = q[rejected, at]
    residual = (p_n - q_n).clamp_min(0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_n)
    extra = sample_from_probs(residual, gens)  # unnormalised weights are fine for the race
    return n.tolist(), extra.tolist()


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """Per row of a [b, k] bool mask, how many entries are True before the first False (int64 [b])."""
    return mask.long().cumprod(dim=1).sum(dim=1)
