"""GrammarTokens: the special tokens a grammar mask treats apart, as packed bit masks.

xgrammar sees GLM's special tokens (`<tool_call>`, `<arg_key>`, `<think>`, ...) as plain text, so a
JSON grammar alone would let one appear inside a JSON string, and a tool-call grammar inside an
argument value, where the parser would then misread the output. The tool-call grammar needs them
as tags, so they cannot be taken out of the vocabulary xgrammar sees; instead `RequestGrammar` ANDs
the grammar's mask with one of these filters:

- ``json_filter``: every special token but the stop tokens banned (JSON never contains one), and
  every token with a raw control byte (< 0x20): xgrammar's JSON strings let them through, JSON
  parsers reject them, and our JSON spacing needs no newline or tab;
- ``only[t]``: every special token but ``t`` banned: inside `<arg_key>` only `</arg_key>` may come,
  inside `<arg_value>` only `</arg_value>`, inside reasoning only `</think>`;
- ``reasoning``: the mask of free reasoning text: no special token but `</think>`.

Where a token stands (outside, inside reasoning, a key or a value) is read from the text, as the
parser reads it: a model may spell a tag with ordinary tokens instead of the special one
(`advance_region`).

Masks are xgrammar's layout: int32 words, bit ``i % 32`` of word ``i // 32`` set = token ``i`` allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmserve.text.special_tokens import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    THINK_END,
    THINK_START,
)
from glmserve.text.tokenizer import Tokenizer

OUTSIDE, THINK, KEY, VALUE = 0, 1, 2, 3
_TAGS = {THINK_START: THINK, THINK_END: OUTSIDE, ARG_KEY_START: KEY, ARG_KEY_END: OUTSIDE,
         ARG_VALUE_START: VALUE, ARG_VALUE_END: OUTSIDE}
_TAIL = max(len(t) for t in _TAGS)  # bytes of text kept to find a tag that spans tokens


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> [ceil(V / 32)] int32 in xgrammar's bitmask layout."""
    words = (allowed.numel() + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: allowed.numel()] = allowed.to(torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # wrap to int32


def unpack_bits(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Inverse of `pack_bits`: [..., W] int32 -> [..., vocab_size] bool."""
    ids = torch.arange(vocab_size)
    return ((words[..., ids // 32] >> (ids % 32)) & 1).bool()


@dataclass(frozen=True)
class GrammarTokens:
    vocab_size: int
    special_ids: frozenset[int]
    stop_ids: tuple[int, ...]
    think_start: int | None
    think_end: int | None
    closer: dict[int, int]  # a region -> the only special token allowed in it (the one closing it)
    json_filter: torch.Tensor
    only: dict[int, torch.Tensor]
    reasoning: torch.Tensor
    token_bytes: list[bytes]

    def advance_region(self, region: int, tail: bytes, token: int) -> tuple[int, bytes]:
        """The region after ``token`` and the text tail to carry on, given the previous ones: the
        last tag that ends in the new text decides."""
        text = tail + self.token_bytes[token]
        best = -1
        for tag, after in _TAGS.items():
            at = text.rfind(tag.encode())
            if at >= 0 and at + len(tag) > len(tail) and at + len(tag) > best:  # a tag this token completes
                best, region = at + len(tag), after
        return region, text[-_TAIL:]

    @property
    def num_words(self) -> int:
        return (self.vocab_size + 31) // 32

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarTokens:
        special = frozenset(i for i in tokenizer.special_ids if i < vocab_size)
        stops = tuple(tokenizer.eos_token_ids)
        ids = {name: tokenizer.token_to_id(name) for name in _TAGS}
        closer = {region: ids[end] for region, end in ((KEY, ARG_KEY_END), (VALUE, ARG_VALUE_END), (THINK, THINK_END))
                  if ids[end] is not None}

        token_bytes = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        control = [i for i, b in enumerate(token_bytes) if i not in special and any(c < 0x20 for c in b)]

        def allowing(keep: set[int], banned: list[int] = ()) -> torch.Tensor:
            allowed = torch.ones(vocab_size, dtype=torch.bool)
            allowed[[i for i in special if i not in keep]] = False
            allowed[list(banned)] = False
            allowed[tokenizer.vocab_size :] = False  # padding rows of the logits: no token at all
            return pack_bits(allowed)

        think_end = ids[THINK_END]
        only = {t: allowing({t}) for t in set(closer.values())}
        token_bytes += [b""] * (vocab_size - len(token_bytes))
        return cls(vocab_size, special, stops, ids[THINK_START], think_end, closer,
                   json_filter=allowing(set(stops), control), only=only,
                   reasoning=allowing({think_end} if think_end is not None else set()), token_bytes=token_bytes)
