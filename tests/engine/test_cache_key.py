"""The engine's prefix-cache key: revision and tokenizer digest in the root, the tenant salt in the
first block; exact reuse counts (a random tiny model, greedy, one engine per case)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from engine_fixtures import random_model

from glmserve.core.block_hash import CacheKeyRoot, block_hashes
from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.model.kv_layout import LAYOUT_VERSION
from glmserve.text.tokenizer_digest import tokenizer_digest

BS = 16
PROMPT = [(7 * i) % 250 + 2 for i in range(70)]  # 4 full blocks; at most floor(69 / 16) = 4 reused
ONE = SamplingParams(max_tokens=1)
BUNDLED = Path(__file__).resolve().parents[2] / "models" / "glm52-tiny"


@pytest.fixture(scope="module")
def model():
    return random_model(0)


def engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(block_size=BS, kv_cache_bytes=2 * 2**20, mtp="off"), **kw)


def cached(e: Engine, prompt: list[int], rid: str, salt: str | None = None) -> int:
    req = e.add_request(rid, prompt, ONE, cache_salt=salt)
    while e.has_unfinished():
        e.step()
    return req.num_cached_prompt


def test_root_is_the_documented_cache_key(model) -> None:
    e = engine(model, revision="rev-a", tokenizer_digest="tok-1")
    want = CacheKeyRoot("rev-a", "tok-1", str(model.dtype), BS, LAYOUT_VERSION).root_hash()
    assert e.kv.root_hash == want
    assert engine(model, revision="rev-b", tokenizer_digest="tok-1").kv.root_hash != want
    assert engine(model, revision="rev-a", tokenizer_digest="tok-2").kv.root_hash != want
    cached(e, PROMPT, "a")  # the committed blocks are exactly the core module's chain under that root
    assert len(e.pool.lookup(block_hashes(want, PROMPT, BS))) == 4


def test_salts_separate_tenants_and_a_changed_token_keeps_the_blocks_before_it(model) -> None:
    e = engine(model, revision="rev-a", tokenizer_digest="tok-1")
    assert cached(e, PROMPT, "t1-1", "tenant-1") == 0
    assert cached(e, PROMPT, "t2-1", "tenant-2") == 0
    assert cached(e, PROMPT, "none-1") == 0
    assert cached(e, PROMPT, "t1-2", "tenant-1") == 4 * BS
    changed = list(PROMPT)
    changed[40] += 1  # block 2
    assert cached(e, changed, "t1-3", "tenant-1") == 2 * BS
    e.pool.check_integrity()


def test_tokenizer_digest_covers_the_tokenizer_files(tmp_path: Path) -> None:
    base = tokenizer_digest(BUNDLED)
    assert base == tokenizer_digest(BUNDLED) and len(base) == 32
    copy = tmp_path / "m"
    copy.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(BUNDLED / name, copy / name)
    assert tokenizer_digest(copy) == base  # weights and config are not part of it
    (copy / "chat_template.jinja").write_text((BUNDLED / "chat_template.jinja").read_text() + " ")
    assert tokenizer_digest(copy) != base
    with pytest.raises(ValueError, match="model_dir"):
        tokenizer_digest(tmp_path)
