"""What a prefill-only request hands to decode besides its KV blocks (torch-free records).

A prefill worker's engine finishes a request with ``hold_blocks``; `HeldPrefill` is what it kept
(read on the engine thread, copied). The decode worker's engine continues the request from a
`PrefillOutput` once the KV has arrived (``Engine.add_prefilled``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmserve.core.generation import TopLogprobs


@dataclass(frozen=True)
class PrefillOutput:
    """The first token, computed by prefill, and the MTP seed.

    - ``first_logprob`` / ``first_top_logprobs``: the first token's logprob and most likely
      alternatives when the request asked for logprobs (else None / empty).
    - ``mtp_hidden``: float32 little-endian [hidden_size], the normed hidden state of the last
      prompt token; with the first token it seeds MTP drafting.
    - ``num_cached_tokens``: prompt tokens the prefill worker found in its prefix cache.
    """

    first_token: int
    mtp_hidden: bytes
    first_logprob: float | None = None
    first_top_logprobs: TopLogprobs = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class HeldPrefill:
    """A finished prefill-only request: the blocks holding its prompt KV (owned until
    ``Engine.release``), what decode needs to continue it, and how long its phases took."""

    block_ids: list[int]
    output: PrefillOutput
    queue_s: float | None = None  # arrival at the engine to first scheduled
    compute_s: float | None = None  # first scheduled to the first token (the prompt's KV computed)
