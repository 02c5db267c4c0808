"""Trace hash ids as prompts: every id becomes a fixed block, so requests that share leading ids
share an exact prompt prefix, as in the traced workload.

Two forms (``--prompt-format``):

- ``tokens`` (`TokenBlocks`): a block is ``tokens_per_block`` token ids drawn from a seeded
  generator, sent as a token-id prompt to ``/v1/completions`` (glmserve, vLLM and SGLang accept
  them). The server sees exactly these tokens: prefixes and lengths are exact, no tokenizer needed.
  This is the default because it is the only form whose shared prefix is exact by construction.
- ``text`` (`TextBlocks`): a block is a line of words ending in a newline, for servers or APIs
  (chat) without token-id prompts. A block starts with a word and ends with ``"\\n"``, which
  byte-level BPE pre-tokenizers split before and after, so a block tokenizes the same wherever it
  stands and shared ids are shared token prefixes; lengths are approximate unless a tokenizer is
  given (then each block is grown to ``tokens_per_block`` tokens exactly).

``salt`` changes every block: a rate sweep's sections use different salts so that one section's
cache does not serve the next.
"""

from __future__ import annotations

from collections.abc import Sequence

from glmserve.loadgen.synthetic_text import WORDS, seeded


class TokenBlocks:
    def __init__(self, tokens_per_block: int, token_ids: Sequence[int], salt: int = 0):
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block: must be >= 1, got {tokens_per_block}")
        if len(token_ids) < 2:
            raise ValueError("token_ids: need at least two token ids to draw from")
        self.tokens_per_block, self.token_ids, self.salt = tokens_per_block, list(token_ids), salt
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            rng = seeded("token-block", self.salt, hash_id)
            self._blocks[hash_id] = rng.choices(self.token_ids, k=self.tokens_per_block)
        return self._blocks[hash_id]

    def prompt(self, hash_ids: Sequence[int], length: int) -> list[int]:
        """The first ``length`` tokens of the blocks of ``hash_ids``."""
        out: list[int] = []
        for hash_id in hash_ids:
            out += self.block(hash_id)
            if len(out) >= length:
                break
        return out[:length]


class TextBlocks:
    def __init__(self, tokens_per_block: int, salt: int = 0, tokenizer=None):
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block: must be >= 1, got {tokens_per_block}")
        self.tokens_per_block, self.salt, self.tokenizer = tokens_per_block, salt, tokenizer
        self._blocks: dict[int, list[str]] = {}

    def _words(self, hash_id: int) -> list[str]:
        """The block's words; with a tokenizer, just enough that the line is ``tokens_per_block`` tokens."""
        if hash_id in self._blocks:
            return self._blocks[hash_id]
        rng = seeded("text-block", self.salt, hash_id)
        chosen = [rng.choice(WORDS) for _ in range(self.tokens_per_block)]
        if self.tokenizer is not None:
            while len(chosen) > 1 and len(self.tokenizer.encode(" ".join(chosen) + "\n")) > self.tokens_per_block:
                chosen.pop()
        self._blocks[hash_id] = chosen
        return chosen

    def block(self, hash_id: int) -> str:
        return " ".join(self._words(hash_id)) + "\n"

    def prompt(self, hash_ids: Sequence[int], length: int) -> str:
        """Whole blocks for all ids but the last; of the last, its share of ``length``."""
        full = len(hash_ids) - 1
        last_share = max(1, length - full * self.tokens_per_block) / self.tokens_per_block
        last = self._words(hash_ids[-1])
        head = "".join(self.block(h) for h in hash_ids[:-1])
        return head + " ".join(last[: max(1, round(len(last) * min(1.0, last_share)))]) + "\n"
