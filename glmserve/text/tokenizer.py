"""Tokenizer of a model dir (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`).

Wraps `tokenizers.Tokenizer` directly: the router never needs transformers, and the results are the
same ids `transformers.AutoTokenizer` gives for the same dir (tests check this).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from glmserve.text.chat import render_chat
from glmserve.text.special_tokens import EOS_TOKENS

CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-char table that the ByteLevel pre-tokenizer uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ):
        self._backend = backend
        self.config = dict(config or {})
        self.chat_template = chat_template or self.config.get("chat_template")
        added = backend.get_added_tokens_decoder()
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.eos_token_ids: tuple[int, ...] = tuple(
            i for i in (backend.token_to_id(t) for t in EOS_TOKENS) if i is not None
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"model_dir: no tokenizer.json in {d}")
        config_path, template_path = d / "tokenizer_config.json", d / CHAT_TEMPLATE_FILE
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = template_path.read_text() if template_path.is_file() else None
        return cls(tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")), config, template)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: no BOS/EOS added; special tokens written in the text still match.
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        if not self.chat_template:
            raise ValueError(f"tokenizer has no chat template ({CHAT_TEMPLATE_FILE} missing)")
        return render_chat(messages, tools, add_generation_prompt, self.chat_template, template_kwargs)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.encode(self.render_chat(messages, tools, add_generation_prompt, template_kwargs))

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        # Built once (about 0.3 s for a 150K vocab) for the incremental detokenizer.
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            raise ValueError("token bytes need a ByteLevel decoder (GLM tokenizers are byte-level)")
        table = _byte_decoder()
        out: list[bytes] = []
        for i in range(self.vocab_size):
            if i in self._added:
                out.append(self._added[i].encode())
                continue
            token = self._backend.id_to_token(i) or ""
            out.append(bytes(table[c] for c in token) if all(c in table for c in token) else token.encode())
        return out

    @cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for: a text of N characters has at least
        N / max_token_bytes tokens (a character is at least one byte), known without encoding it."""
        return max(1, *(len(b) for b in self._token_bytes))

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """The raw bytes a token stands for (may be part of a UTF-8 character)."""
        if skip_special_tokens and token_id in self.special_ids:
            return b""
        return self._token_bytes[token_id]
