"""Sampler: a batch of logits plus per-request SamplingParams -> the next token of each request.

Processing order for sampled rows (the same everywhere, so speculative decoding can compare the
target and draft distributions): temperature, then min-p, then top-k, then top-p, all in float32.
(Grammar masks, logit bias and penalties come before, in `logits_adjust`.)

- min-p drops every token whose probability is below ``min_p`` times the most likely token's
  (compared as logits: ``x < max(x) + log(min_p)``).

- top-k keeps every token whose scaled logit is >= the k-th largest one (ties at the threshold are
  all kept, so more than k tokens survive only when logits tie exactly).
- top-p keeps the smallest prefix of the tokens sorted by probability (descending; equal
  probabilities in token-id order) whose total is >= top_p, measured after top-k; the most likely
  token is always kept.
- Greedy rows (``SamplingParams.is_greedy``) take ``argmax`` of the raw logits; ties go to the
  lowest token id. Their "processed distribution" is one-hot on that token.

Sampling draws with the exponential race (``argmax(p / E)``, ``E ~ Exp(1)`` i.i.d.), which equals a
categorical draw from ``p`` and lets each row take its random numbers from its own generator. A
row's tokens therefore depend only on its logits, its params and its generator, never on which
other requests share the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from glmserve.core.generation import SamplingParams
from glmserve.model.greedy import greedy_ids

Generators = Sequence[torch.Generator | None]


@dataclass(frozen=True)
class SampleOutput:
    """``token_ids`` [B] int64; ``logprobs`` [B] float32: log-probability of each chosen token under
    the unprocessed model distribution (``log_softmax`` of the raw logits); ``top_logprobs[i]``: the
    ``params[i].logprobs`` most likely (token id, logprob) pairs under that same distribution, most
    likely first, or None when the request asked for none."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_logprobs: list[list[tuple[int, float]] | None]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from ``seed`` on ``device`` (None for None: use the default generator).
    Create it on the device the logits live on; a CPU generator works too but costs a copy."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def _per_row_random(
    rows: int,
    width: int,
    generators: Generators,
    device: torch.device,
    fill: Callable[[torch.Tensor, torch.Generator | None], torch.Tensor],
) -> torch.Tensor:
    """[rows, width] float32 random numbers; row i comes from ``generators[i]`` (None rows share the
    default generator of ``device`` in one call)."""
    out = torch.empty(rows, width, dtype=torch.float32, device=device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        out[shared] = fill(torch.empty(len(shared), width, dtype=torch.float32, device=device), None)
    for i, g in enumerate(generators):
        if g is not None:
            # Draw on the generator's own device (torch requires it), then move.
            out[i] = fill(torch.empty(width, dtype=torch.float32, device=g.device), g).to(device)
    return out


def uniform(rows: int, width: int, generators: Generators, device: torch.device) -> torch.Tensor:
    """[rows, width] float32 uniforms in [0, 1), row i drawn from ``generators[i]``."""
    return _per_row_random(rows, width, generators, device, lambda t, g: t.uniform_(generator=g))


def sample_from_probs(probs: torch.Tensor, generators: Generators) -> torch.Tensor:
    """One token per row of ``probs`` [N, V] (non-negative weights, each row with positive mass; rows
    need not be normalised), row i using ``generators[i]``. Returns int64 [N]."""
    if probs.shape[0] != len(generators):
        raise ValueError(f"generators: {len(generators)} for {probs.shape[0]} rows")
    noise = _per_row_random(*probs.shape, generators, probs.device, lambda t, g: t.exponential_(generator=g))
    # Exp(1) can return exactly 0; clamp so a zero-weight token can never win by 0/0 or x/0.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return greedy_ids(probs.float() / noise)


def _split(params: Sequence[SamplingParams]) -> tuple[list[int], list[int]]:
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    return greedy, sampled


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p for non-greedy rows: float32 logits [N, V] -> probs [N, V]."""
    n, vocab = logits.shape
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    x = logits / temps.unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params],
                                 dtype=torch.float32, device=device)
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + log_min_p.unsqueeze(1), float("-inf"))
    ks = [min(p.top_k, vocab) if p.top_k_enabled else vocab for p in params]
    need_k = any(k < vocab for k in ks)
    need_p = any(p.top_p < 1 for p in params)
    if not (need_k or need_p):
        return x.softmax(dim=-1)
    # One stable sort serves both filters; equal logits stay in token-id order.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    if need_k:
        kth = sorted_x.gather(1, torch.tensor(ks, device=device).sub(1).unsqueeze(1))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if need_p:
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device).unsqueeze(1)
        sorted_probs = sorted_x.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exactly 0 for the first token
        # Rows with top_p == 1 are left alone: float cumsum can reach 1 before the tail ends.
        drop = (mass_before >= top_p) & (top_p < 1)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x).softmax(dim=-1)


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from, float32, rows summing to 1.

    ``logits`` is [B, V] or [B, T, V] (T positions of the same request share ``params[b]``).
    Greedy rows give one-hot on the argmax."""
    if logits.dim() == 3:
        b, t, vocab = logits.shape
        flat = processed_probs(logits.reshape(b * t, vocab), [p for p in params for _ in range(t)])
        return flat.reshape(b, t, vocab)
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(
            f"logits: expected [B, V] or [B, T, V] with B = {len(params)}, got {tuple(logits.shape)}"
        )
    logits = logits.float()
    greedy, sampled = _split(params)
    if not greedy:  # common fast path: no indexing copies
        return _filtered_probs(logits, params)
    probs = torch.zeros_like(logits)
    probs[greedy, greedy_ids(logits[greedy])] = 1.0
    if sampled:
        probs[sampled] = _filtered_probs(logits[sampled], [params[i] for i in sampled])
    return probs


class Sampler:
    """Stateless batched sampler; see the module docstring for the exact processing contract."""

    def processed_probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Same as the module-level ``processed_probs``."""
        return processed_probs(logits, params)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Generators | None = None,
    ) -> SampleOutput:
        """Choose one token per row of ``logits`` [B, V]; row i follows ``params[i]`` and draws its
        random numbers from ``generators[i]`` (None, or a None entry: the default generator)."""
        batch = logits.shape[0]
        if logits.dim() != 2 or batch != len(params):
            raise ValueError(f"logits: expected [B, V] with B = {len(params)}, got {tuple(logits.shape)}")
        generators = [None] * batch if generators is None else list(generators)
        if len(generators) != batch:
            raise ValueError(f"generators: {len(generators)} for a batch of {batch}")
        logits = logits.float()
        greedy, sampled = _split(params)
        if not sampled:
            token_ids = greedy_ids(logits)
        else:
            token_ids = torch.empty(batch, dtype=torch.long, device=logits.device)
            if greedy:
                token_ids[greedy] = greedy_ids(logits[greedy])
            probs = _filtered_probs(logits[sampled], [params[i] for i in sampled])
            token_ids[sampled] = sample_from_probs(probs, [generators[i] for i in sampled])
        log_z = torch.logsumexp(logits, dim=-1)
        chosen = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - log_z
        return SampleOutput(token_ids, chosen, _top_logprobs(logits, log_z, params))


def _top_logprobs(
    logits: torch.Tensor, log_z: torch.Tensor, params: Sequence[SamplingParams]
) -> list[list[tuple[int, float]] | None]:
    """Top-n (id, logprob) per row under the raw distribution; one topk call for the whole batch."""
    out: list[list[tuple[int, float]] | None] = [None if p.logprobs is None else [] for p in params]
    rows = [i for i, p in enumerate(params) if p.logprobs]
    if not rows:
        return out
    n = min(max(params[i].logprobs or 0 for i in rows), logits.shape[1])
    values, ids = logits[rows].topk(n, dim=-1)
    values = (values - log_z[rows].unsqueeze(1)).tolist()
    ids = ids.tolist()
    for j, i in enumerate(rows):
        m = params[i].logprobs or 0
        out[i] = list(zip(ids[j][:m], values[j][:m], strict=True))
    return out
