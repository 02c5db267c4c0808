"""The generation contract: what a request asks of generation and what flows back, torch-free.

Every layer speaks these types: the router builds `SamplingParams` from an OpenAI body, the proto
converters carry them, the engine consumes them; the engine's step returns `TokenEvent`s, which
decode, both proto converters and every router backend carry unchanged (DESIGN invariant 10).

- `SamplingParams`: sampling and stop rules of one request (validated on construction; each
  ``ValueError`` message starts with the field's name, so the router can answer a 400 naming it).
- `FinishReason`: why a request ended. "stop": an eos token, a stop token id or a stop string;
  "length": ``max_tokens`` reached; "abort": stopped by a client, an operator or shutdown;
  "error": generation failed (the event's ``error`` says why).
- `TokenEvent`: new output of one request since its previous event (see its docstring).

This module imports only `glmserve.core` and never torch (the router imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from glmserve.core.grammar_spec import GrammarSpec

# Below this temperature we take the argmax: dividing logits by it would overflow float32.
GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as OpenAI allows
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most, as OpenAI allows
MAX_VISIBLE_SPECIAL_TOKENS = 64
# The range torch.Generator.manual_seed accepts.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings (immutable, validated on construction).

    - ``max_tokens``: generated tokens at most (>= 1); reaching it finishes with "length".
    - ``temperature``: >= 0; 0 (anything below ``GREEDY_TEMPERATURE``) means greedy argmax.
    - ``top_p``: nucleus sampling, 0 < top_p <= 1 (1 = off).
    - ``top_k``: keep the k most likely tokens; -1 or 0 = off.
    - ``seed``: makes sampling reproducible (a per-request generator); None = engine default.
    - ``stop_token_ids``: token ids that finish generation with "stop" (even with ``ignore_eos``).
    - ``stop``: up to 16 non-empty stop strings; output is cut before the first one (a single
      string is accepted and wrapped).
    - ``ignore_eos``: keep generating past the model's eos token(s).
    - ``logprobs``: None = no logprobs; 0..20 = each token's logprob and that many most likely
      alternatives (``TokenEvent.top_logprobs``).
    - ``visible_special_tokens``: special tokens (by their text, e.g. ``"<tool_call>"``) that stay in
      the output text; every other special token is hidden. The router keeps the tool-call markup
      visible when a request has tools, so its parser sees the calls.
    - ``min_p``: drop tokens whose probability (after temperature) is below ``min_p`` times the
      most likely one's; 0 = off.
    - ``repetition_penalty``: > 0; logits of tokens already in the prompt or the output are divided
      by it when positive, multiplied when negative (1 = off).
    - ``presence_penalty`` / ``frequency_penalty``: in [-2, 2]; subtracted from the logit of each
      token generated so far, once / once per occurrence (0 = off).
    - ``logit_bias``: (token id, bias in [-100, 100]) pairs added to the logits (a dict is accepted).
    - ``banned_token_ids``: token ids never generated (their logits are -inf before sampling and
      draft verification, whatever the bias); the router bans the tool-call markup for
      ``tool_choice="none"``.
    - ``grammar``: the output must match it (`GrammarSpec`); None = free.
    - ``num_resumed``: the last ``num_resumed`` prompt ids are this request's own output from an
      earlier attempt (a stream migrated off a decode worker that died): their text was already
      sent (the engine makes it again, for stop strings and characters across the seam, but does
      not emit it), and penalties and the grammar count them as output. ``max_tokens`` is what is
      left. 0 for every request a client sends.

    Order of processing: logit_bias, repetition, presence and frequency penalties, the banned
    tokens, the grammar mask (on the logits, greedy rows too), then temperature, min_p, top-k, top-p (sampled rows).
    Sequences (lists) are stored as tuples so the object stays hashable.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    visible_special_tokens: tuple[str, ...] = ()
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None
    banned_token_ids: tuple[int, ...] = ()
    num_resumed: int = 0

    def __post_init__(self) -> None:
        # Normalise list inputs to tuples before validating (frozen: bypass __setattr__).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias))
        for name in ("stop", "stop_token_ids", "visible_special_tokens", "banned_token_ids"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError("<field>: ...")`` for the first invalid field."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an int >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: must be -1 or 0 (off) or an int >= 1, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed: must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids: must be a sequence of ints >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop: must be a string or a sequence of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs: must be None or an int in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        visible = self.visible_special_tokens
        if not isinstance(visible, tuple) or not all(isinstance(t, str) and t for t in visible):
            raise ValueError(f"visible_special_tokens: must be a sequence of non-empty strings, got {visible!r}")
        if len(visible) > MAX_VISIBLE_SPECIAL_TOKENS:
            raise ValueError(f"visible_special_tokens: at most {MAX_VISIBLE_SPECIAL_TOKENS}, got {len(visible)}")
        self._validate_processing()

    def _validate_processing(self) -> None:
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or abs(value) > MAX_PENALTY:
                raise ValueError(f"{name}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) and p[0] >= 0 and _is_real(p[1])
            and abs(p[1]) <= MAX_LOGIT_BIAS for p in self.logit_bias
        ):
            raise ValueError(f"logit_bias: must map token ids >= 0 to biases in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {self.logit_bias!r}")
        if not isinstance(self.banned_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.banned_token_ids
        ):
            raise ValueError(f"banned_token_ids: must be a sequence of ints >= 0, got {self.banned_token_ids!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar: must be a GrammarSpec or None, got {type(self.grammar).__name__}")
        if not _is_int(self.num_resumed) or self.num_resumed < 0:
            raise ValueError(f"num_resumed: must be an int >= 0, got {self.num_resumed!r}")

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding: temperature ~0, or top_k 1 (which leaves only the argmax anyway)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1

    @property
    def has_penalties(self) -> bool:
        """Logits depend on the tokens so far (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Anything applies to the logits before the sampler (grammar, bias, bans, penalties)."""
        return self.grammar is not None or bool(self.logit_bias) or bool(self.banned_token_ids) or self.has_penalties


def check_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_positions: int) -> None:
    """Raise ``ValueError("prompt_ids: ...")`` unless the prompt can run: at least one token, every
    id in the vocabulary, and prompt plus ``max_tokens`` within the model's positions. The one check
    every entry point (engine, decode worker) runs; the router answers the same cases earlier with
    its OpenAI errors."""
    if not prompt_ids:
        raise ValueError("prompt_ids: a prompt needs at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt_ids: token ids out of range [0, {vocab_size}): {bad[:5]}")
    if params.num_resumed >= len(prompt_ids):
        raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens cannot hold num_resumed={params.num_resumed} "
                         "resumed output tokens and a prompt")
    if len(prompt_ids) + params.max_tokens > max_positions:
        raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens plus max_tokens {params.max_tokens} "
                         f"exceed the model's {max_positions} positions")


FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort", "error"})

TopLogprobs = list[tuple[int, float]]
"""The most likely tokens at one position, as (token id, logprob), most likely first."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New output of one request since its previous event; a stream of them ends with exactly one
    event whose ``finish_reason`` is set (``finished``).

    - ``token_ids``: newly generated ids, in order (one, or several with speculative decoding).
      A final eos / stop token id is included (it counts as generated) but is not in ``text``.
    - ``text``: the text these ids add, made once where the engine runs (incremental detokenizer,
      special tokens hidden unless asked for, stop strings applied: the text ends before a stop
      string, and a tail that could still become one is held back until it cannot). Consumers
      append it; they never decode ids again.
    - ``logprobs``: per id in ``token_ids``, its log-probability under the model's raw distribution
      (log_softmax of the logits, before temperature, penalties or masks); empty unless
      ``params.logprobs`` is not None.
    - ``top_logprobs``: per id in ``token_ids``, the ``params.logprobs`` most likely tokens at that
      position; empty unless ``params.logprobs`` >= 1.
    - ``finish_reason`` / ``stop_reason``: set on the last event. ``stop_reason`` is the stop token
      id or stop string that ended the request (None for eos, length, abort, error), as in vLLM.
    - ``num_cached_tokens``: prompt tokens served from the prefix cache (0 until known).
    - ``error``: what went wrong, with ``finish_reason == "error"`` (or why, with "abort").

    Fields are not copied: producers hand over lists they no longer mutate.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def ended(cls, request_id: str, reason: FinishReason, error: str | None = None,
              num_cached_tokens: int = 0) -> TokenEvent:
        """A final event without new tokens ("abort" or "error", with what happened)."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason: must be one of {sorted(FINISH_REASONS)}, got {reason!r}")
        return cls(request_id, finish_reason=reason, error=error, num_cached_tokens=num_cached_tokens)
