"""Hash ids as prompt blocks: the same id is the same block every time, shared leading ids are an
exact shared prefix (token ids, and text whose tokenization is stable across block boundaries)."""

from __future__ import annotations

from pathlib import Path

from glmserve.loadgen.prompt_blocks import TextBlocks, TokenBlocks
from glmserve.text.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parents[2] / "models" / "glm52-tiny"


def test_token_blocks_are_deterministic_and_shared_ids_share_a_prefix() -> None:
    a, b = TokenBlocks(16, range(1000, 8000)), TokenBlocks(16, range(1000, 8000))
    p1, p2 = a.prompt([1, 2, 3], 40), b.prompt([1, 2, 4], 48)
    assert len(p1) == 40 and len(p2) == 48
    assert p1[:32] == p2[:32] and p1[32:40] != p2[32:40]
    assert all(1000 <= t < 8000 for t in p1 + p2)
    assert TokenBlocks(16, range(1000, 8000), salt=1).block(1) != a.block(1)  # a sweep section's own blocks


def test_text_blocks_tokenize_the_same_wherever_they_stand() -> None:
    tokenizer = Tokenizer.from_dir(MODEL)
    blocks = TextBlocks(24, tokenizer=tokenizer)
    ids = [tokenizer.encode(blocks.block(h)) for h in range(6)]
    assert all(0 < len(i) <= 24 for i in ids)
    assert tokenizer.encode("".join(blocks.block(h) for h in range(6))) == [t for i in ids for t in i]
    shared = tokenizer.encode(blocks.prompt([0, 1, 2], 72))
    other = tokenizer.encode(blocks.prompt([0, 1, 5], 72))
    n = len(ids[0]) + len(ids[1])
    assert shared[:n] == other[:n] and shared[n:] != other[n:]
