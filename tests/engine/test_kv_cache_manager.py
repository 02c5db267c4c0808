"""KVCacheManager on its own: blocks grow and shrink with a request, only fully computed blocks are
hashed and committed, and a later request with the same prefix (and salt) reuses them."""

from __future__ import annotations

from glmserve.core.block_hash import block_hashes
from glmserve.core.generation import SamplingParams
from glmserve.engine.kv_cache_manager import KVCacheManager
from glmserve.engine.request import Request
from glmserve.kv.block_pool import BlockPool

BLOCK = 4
ROOT = b"r" * 16


def _kv(num_blocks: int = 16, root: bytes | None = ROOT) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), BLOCK, root)


def _req(tokens: list[int], salt: str | None = None) -> Request:
    return Request("r", tokens, SamplingParams(), cache_salt=salt)


def test_ensure_grows_and_refuses_without_changing_anything():
    kv = _kv(num_blocks=3)
    req = _req(list(range(10)))
    assert kv.ensure(req, 9) and len(req.block_ids) == 3
    other = _req([1])
    assert not kv.ensure(other, 1) and other.block_ids == []  # full: nothing allocated
    kv.trim(req, 4)
    assert len(req.block_ids) == 1 and kv.pool.num_free == 2


def test_only_computed_full_blocks_are_committed_with_the_chained_hash():
    kv = _kv()
    tokens = list(range(100, 111))  # 11 tokens: two full blocks, a partial one
    req = _req(tokens)
    kv.ensure(req, 11)
    req.num_computed = 7
    kv.commit_full_blocks(req)
    assert req.block_hashes == block_hashes(ROOT, tokens[:4], BLOCK)  # the second block is not computed yet
    req.num_computed = 11
    kv.commit_full_blocks(req)
    assert req.block_hashes == block_hashes(ROOT, tokens[:8], BLOCK)


def test_a_later_request_reuses_the_prefix_but_never_its_last_token():
    kv = _kv()
    tokens = list(range(200, 213))
    first = _req(tokens)
    kv.ensure(first, len(tokens))
    first.num_computed = len(tokens)
    kv.commit_full_blocks(first)
    cached = list(first.block_ids[:3])
    kv.free(first)
    again = _req(tokens[:8])  # 8 tokens = 2 full blocks, but the last token must be computed
    kv.match_prefix(again)
    assert again.num_computed == again.num_cached_prompt == 4 and len(again.block_ids) == 1
    longer = _req(tokens + [1])
    kv.match_prefix(longer)
    assert longer.num_computed == 12 and longer.block_ids == cached


def test_another_salt_or_caching_off_finds_nothing():
    kv = _kv()
    tokens = list(range(300, 309))
    first = _req(tokens, salt="tenant-a")
    kv.ensure(first, 9)
    first.num_computed = 9
    kv.commit_full_blocks(first)
    kv.free(first)
    other = _req(tokens, salt="tenant-b")
    kv.match_prefix(other)
    assert other.num_computed == 0 and other.block_ids == []
    off = _kv(root=None)
    req = _req(tokens)
    off.ensure(req, 9)
    req.num_computed = 9
    off.commit_full_blocks(req)
    assert req.block_hashes == []


def test_free_tells_the_listener_then_releases_tail_first():
    kv = _kv()
    seen = []
    kv.on_free = lambda ids, hashes: seen.append((list(ids), list(hashes)))
    req = _req(list(range(8)))
    kv.ensure(req, 8)
    req.num_computed = 8
    kv.commit_full_blocks(req)
    blocks = list(req.block_ids)
    kv.free(req)
    assert seen == [(blocks, block_hashes(ROOT, list(range(8)), BLOCK))]
    assert req.block_ids == [] and kv.pool.num_used == 0
