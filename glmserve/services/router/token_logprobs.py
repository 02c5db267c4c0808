"""Logprobs as the OpenAI API shows them: each token's text and bytes next to its logprob and its
most likely alternatives. The values come from the events (`TokenEvent.logprobs`,
``top_logprobs``); only the tokens' spellings are looked up here (a table lookup per id, not
decoding: special tokens show as themselves, and a token may be part of a UTF-8 character)."""

from __future__ import annotations

from dataclasses import dataclass, field

from glmserve.core.generation import TokenEvent
from glmserve.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Alternative:
    token: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its spelling, logprob, and the most likely tokens at its position."""

    token: str
    bytes: bytes
    logprob: float
    top: list[Alternative] = field(default_factory=list)


def token_logprobs(tokenizer: Tokenizer, event: TokenEvent) -> list[TokenLogprob]:
    """An entry per token of ``event`` that has a logprob (none when the request asked for none)."""

    def spell(token_id: int) -> tuple[str, bytes]:
        raw = tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    out = []
    for i, (token_id, logprob) in enumerate(zip(event.token_ids, event.logprobs, strict=False)):
        top = event.top_logprobs[i] if i < len(event.top_logprobs) else []
        out.append(TokenLogprob(*spell(token_id), logprob, [Alternative(*spell(t), lp) for t, lp in top]))
    return out
