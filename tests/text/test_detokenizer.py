"""Incremental detokenizer: deltas join to decode(ids) and never contain a broken character."""

from __future__ import annotations

from pathlib import Path

import pytest

from glmserve.text.detokenizer import IncrementalDetokenizer
from glmserve.text.tokenizer import Tokenizer
from tools.tiny_tokenizer import save_tokenizer, train_tokenizer

SAMPLES = [
    "def f(x):\n    return x + 1  # plain ASCII\n",
    "emoji 😀🚀👩‍💻, CJK 中文字符, accents é e\u0301 ß Ω, box ─│┌, math ∑∫√",
    "<|user|>\nhi 👋<|assistant|>\n<tool_call>read_file<arg_key>path</arg_key><arg_value>ü.py</arg_value></tool_call>",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    # Tiny vocab: multi-byte characters get split into byte tokens, the case that matters here.
    corpus = [Path(__file__).read_text(), *SAMPLES] * 3
    d = tmp_path_factory.mktemp("detok")
    save_tokenizer(train_tokenizer(corpus, vocab_size=400), d)
    return Tokenizer.from_dir(d)


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("skip", [False, True])
def test_one_token_at_a_time(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    assert any(len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids) or text.isascii()
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = [detok.update(ids[: n + 1]) for n in range(len(ids))] + [detok.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_chunks_of_ids(tok: Tokenizer) -> None:
    ids = tok.encode(SAMPLES[1])
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.finish()
    assert out == SAMPLES[1]


def test_incomplete_character_is_held_then_replaced(tok: Tokenizer) -> None:
    ids = tok.encode("a😀")
    assert len(ids) >= 3  # the emoji is split
    detok = IncrementalDetokenizer(tok)
    assert detok.update(ids[:-1]) == "a"  # the emoji's bytes so far are held back
    assert detok.finish() == "\ufffd"  # the generation stopped mid-character


def test_ids_must_grow(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    detok.update(tok.encode("abc"))
    with pytest.raises(ValueError, match="ids"):
        detok.update([])
