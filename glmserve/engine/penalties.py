"""Logit bias, the repetition, presence and frequency penalties (OpenAI / vLLM semantics), and bans.

On the logits of one request, in this order (the same for every row a step scores, so speculative
verification sees exactly what non-speculative decoding would):

- ``logit_bias``: ``logit[t] += bias[t]``;
- ``repetition_penalty`` r (CTRL / HF / vLLM): every token in the prompt or the output so far has
  its logit divided by r when positive, multiplied by r otherwise;
- ``frequency_penalty`` f and ``presence_penalty`` p: ``logit[t] -= f * count[t] + p * (count[t] > 0)``,
  where count[t] is how often t occurs in the output so far (the prompt does not count);
- ``banned_token_ids``: ``logit[t] = -inf`` (last, so no bias or penalty can bring one back).
"""

from __future__ import annotations

import torch

from glmserve.core.generation import SamplingParams


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> None:
    """In place on ``logits`` [R, V]."""
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype, device=logits.device)
        logits[:, ids] += bias


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None, counts: torch.Tensor
) -> None:
    """In place on ``logits`` [R, V]; ``seen`` [R, V] bool: tokens in the prompt or the output
    (needed only with a repetition penalty); ``counts`` [R, V] float: occurrences in the output."""
    if params.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("seen: a repetition penalty needs the tokens seen so far")
        r = params.repetition_penalty
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, penalised, logits))
    if params.frequency_penalty or params.presence_penalty:
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def apply_bans(logits: torch.Tensor, params: SamplingParams) -> None:
    """In place on ``logits`` [R, V]: the banned tokens can never be sampled or accepted."""
    if params.banned_token_ids:
        ids = torch.tensor(params.banned_token_ids, dtype=torch.long, device=logits.device)
        logits[:, ids] = float("-inf")
