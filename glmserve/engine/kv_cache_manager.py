"""KVCacheManager: which blocks each request holds, prefix reuse through block hashes.

Plain Python over the BlockPool. A request's blocks cover its positions in order; only full blocks
whose every token has been computed are committed (hashed) so that later requests can reuse them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from glmserve.core.block_hash import CacheKeyRoot, block_hashes, reusable_blocks
from glmserve.engine.request import Request
from glmserve.kv.block_pool import BlockPool, OutOfBlocks
from glmserve.model.kv_layout import LAYOUT_VERSION

if TYPE_CHECKING:
    import torch

    from glmserve.engine.engine_config import EngineConfig


def prefix_cache_root(dtype: torch.dtype, config: EngineConfig, revision: str = "",
                      tokenizer_digest: str | None = None) -> bytes:
    """The root of the prefix-cache hash chain: the same for the whole model and for every LayerSplit
    stage of it (a stage holds its slice of the same blocks). Without a tokenizer digest the engine
    only ever sees token ids: a fixed tag says so."""
    key = CacheKeyRoot(revision or "unversioned", tokenizer_digest or "token-ids-only", str(dtype),
                       config.block_size, LAYOUT_VERSION)
    return key.root_hash()


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, root_hash: bytes | None):
        """`root_hash` None turns prefix caching off (nothing committed, nothing looked up)."""
        self.pool = pool
        self.block_size = block_size
        self.root_hash = root_hash
        # Called with (block ids, committed hashes) just before a request releases its blocks
        # (the host tier's write-through); None: nobody listens.
        self.on_free: Callable[[Sequence[int], Sequence[bytes]], None] | None = None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, req: Request) -> None:
        """Attach the longest cached prefix of the prompt (never its last token) to a new request."""
        if self.root_hash is None or req.block_ids:
            return
        n = reusable_blocks(len(req.prompt_ids), self.block_size)
        hashes = block_hashes(self.root_hash, req.prompt_ids[: n * self.block_size], self.block_size,
                              salt=req.cache_salt)
        hits = self.pool.lookup(hashes)
        if hits:
            self.pool.acquire(hits)
        req.block_ids = list(hits)
        req.block_hashes = hashes[: len(hits)]
        req.num_computed = req.mtp_synced = req.num_cached_prompt = len(hits) * self.block_size

    def ensure(self, req: Request, num_tokens: int) -> bool:
        """Grow the request's blocks to hold `num_tokens` positions; False (nothing changed) if full."""
        missing = self.blocks_for(num_tokens) - len(req.block_ids)
        if missing <= 0:
            return True
        try:
            req.block_ids.extend(self.pool.allocate(missing))
        except OutOfBlocks:
            return False
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back blocks beyond what `num_tokens` positions need (e.g. after rejected drafts)."""
        keep = max(self.blocks_for(num_tokens), len(req.block_hashes))
        if len(req.block_ids) > keep:
            extra = req.block_ids[keep:]
            del req.block_ids[keep:]
            self.pool.release(extra[::-1])

    def commit_full_blocks(self, req: Request) -> None:
        """Hash and publish every block whose tokens are all computed."""
        if self.root_hash is None:
            return
        tokens = req.token_ids
        # Accepted drafts count as computed before they are appended to the output: hash known tokens only.
        full = min(req.num_computed, len(tokens)) // self.block_size
        while len(req.block_hashes) < full:
            i = len(req.block_hashes)
            prev = req.block_hashes[-1] if req.block_hashes else self.root_hash
            block = tokens[i * self.block_size : (i + 1) * self.block_size]
            salt = req.cache_salt if i == 0 else None  # the salt enters block 0; later ones chain
            (digest,) = block_hashes(prev, block, self.block_size, salt=salt)
            self.pool.commit(req.block_ids[i], digest)
            req.block_hashes.append(digest)

    def free(self, req: Request) -> None:
        """Release everything the request holds; tail first so its prefix is evicted last."""
        if req.block_ids:
            if self.on_free is not None:
                self.on_free(req.block_ids, req.block_hashes)
            self.pool.release(req.block_ids[::-1])
        req.block_ids = []
        req.block_hashes = []
