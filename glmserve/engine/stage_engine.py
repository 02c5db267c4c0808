"""StageEngine: one LayerSplit prefill stage, chunk by chunk, over its own slice of the KV blocks.

A stage holds a contiguous range of layers (`GlmForCausalLM` with a layer range) and a block pool
whose blocks hold only those layers' KV (`KVLayout.for_config(..., layers=...)`), under the whole
model's prefix-cache root: a block hash names the same tokens in every stage, and each stage's pool
holds its slice of that block. Synchronous and transport-free; the stage service drives it and moves
hidden states, top-k and KV between processes.

A job's life, on every stage alike (the first stage decides the chunks and tells the others):

1. ``begin``: find the prompt's cached prefix in this stage's pool (pinned); returns its length.
2. ``admit(num_cached)``: keep only the prefix every stage has (the replica's hit is the shortest
   stage's), allocate the rest of the prompt's blocks (`OutOfBlocks`: nothing held).
3. ``run_chunk`` for each chunk in order (`chunk_spans`): the previous stage's hidden states (and,
   when this stage starts on a `shared` layer, the top-k it carries) in, this stage's out. After the
   chunks `kv_writes` names, the blocks it lists are complete here and go to the decode worker.
   The last stage also stores the MTP layer's KV and, on the last chunk, samples the first token
   (a `PrefillOutput`).
4. ``release`` once every write of the job's blocks is final: full blocks stay in the prefix cache.

Chunks are computed exactly as the whole-model `Engine` computes one request alone (same spans,
one sequence per forward, MTP KV stored for every prompt position), so a replica of stages writes
the same bytes as one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from glmserve.core.generation import SamplingParams, check_prompt
from glmserve.engine.engine_config import EngineConfig
from glmserve.engine.engine_stats import EngineLimits, EngineLoad, EngineStats
from glmserve.engine.handoff import PrefillOutput
from glmserve.engine.host_offload import HostOffload, HostWrite, attach_host_offload
from glmserve.engine.kv_cache_manager import KVCacheManager, prefix_cache_root
from glmserve.engine.logits_processor import LogitsProcessor
from glmserve.engine.model_runner import ModelRunner
from glmserve.engine.request import Request
from glmserve.engine.sampler import Sampler
from glmserve.kv.block_pool import BlockListener, BlockPool, OutOfBlocks
from glmserve.model.dtype_choice import resolve_dtype
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.kv_layout import KVLayout
from glmserve.model.loader import load_model
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.revision import model_revision
from glmserve.text.tokenizer import Tokenizer
from glmserve.text.tokenizer_digest import tokenizer_digest


def chunk_spans(num_cached: int, prompt_len: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, num_tokens) of each chunk computed after a cached prefix of ``num_cached`` tokens."""
    return [(s, min(chunk_tokens, prompt_len - s)) for s in range(num_cached, prompt_len, chunk_tokens)]


def kv_writes(num_cached: int, prompt_len: int, chunk_tokens: int, block_size: int,
              stream: bool) -> list[tuple[int, range]]:
    """(chunk index, job blocks) of each KV write of a stage: streamed, after every chunk the blocks
    it completed (the first write includes the cached prefix's, the last the partial last block);
    else all blocks once, after the last chunk. Every stage of a replica computes the same list."""
    spans = chunk_spans(num_cached, prompt_len, chunk_tokens)
    total = -(-prompt_len // block_size)
    if not stream:
        return [(len(spans) - 1, range(total))]
    writes, shipped = [], 0
    for i, (start, n) in enumerate(spans):
        done = total if i == len(spans) - 1 else (start + n) // block_size
        if done > shipped:
            writes.append((i, range(shipped, done)))
            shipped = done
    return writes


@dataclass(frozen=True)
class ChunkOutput:
    hidden: torch.Tensor  # [num_tokens, hidden] this stage's output (before the final norm)
    topk: torch.Tensor  # [num_tokens, k] int64: the top-k the stage's last layer used
    handoff: PrefillOutput | None = None  # last stage, last chunk (num_cached_tokens: this stage's)


@dataclass(frozen=True)
class StageGeometry:
    """What the stage's services size their buffers and windows by."""

    hidden_size: int
    dtype: torch.dtype
    index_topk: int
    block_offset: int  # where this stage's rows sit in a whole-model block (bytes)
    block_bytes: int  # this stage's bytes of a block
    whole_block_bytes: int  # a whole-model block (the decode worker's, the host tier's)


@dataclass(eq=False)
class _Job:
    request: Request
    admitted: bool = False


class StageEngine:
    def __init__(self, model: GlmForCausalLM, config: EngineConfig, revision: str = "",
                 tokenizer_digest: str | None = None, tokenizer: Tokenizer | None = None) -> None:
        """``tokenizer``: the last stage's, for grammars (the first token is sampled there)."""
        self.model, self.config = model, config
        self.layers = model.layer_range
        self.use_mtp = model.has_mtp and config.mtp != "off"
        whole_mtp = model.config.num_nextn_predict_layers > 0 and config.mtp != "off"
        self.layout = KVLayout.for_config(model.config, config.block_size, model.dtype, with_mtp=self.use_mtp,
                                          layers=self.layers)
        # Where this stage's blocks sit in a whole-model block (the decode worker's, the host tier's).
        whole = KVLayout.for_config(model.config, config.block_size, model.dtype, with_mtp=whole_mtp)
        self.block_offset, _ = whole.slice_of(self.layers)
        self.whole_block_bytes = whole.bytes_per_block
        num_blocks = config.kv_cache_bytes // self.layout.bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_bytes: {config.kv_cache_bytes} B holds fewer than 2 blocks")
        self.cache = PagedKVCache(self.layout, num_blocks + config.host_staging_blocks)
        self.pool = BlockPool(num_blocks, on_evict=self._evicted)
        self.host_tier: HostOffload | None = None  # the CPU KV tier's engine side, once attached
        root = prefix_cache_root(model.dtype, config, revision, tokenizer_digest) if config.prefix_caching else None
        self.kv = KVCacheManager(self.pool, config.block_size, root)
        self.runner = ModelRunner(model, self.cache)
        self.sampler = Sampler()
        self.logits_processor = LogitsProcessor(tokenizer, model.config.vocab_size)
        self.jobs: dict[str, _Job] = {}
        self.stats = EngineStats()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, layers: range, dtype: torch.dtype | str = "auto",
                       revision: str | None = None, **config) -> StageEngine:
        """A stage holding ``layers`` of the checkpoint (only those weights are read), keyed and
        typed like a whole-model `Engine` of the same directory (`Engine.from_model_dir`)."""
        model = load_model(model_dir, layers=layers, dtype=resolve_dtype(dtype))
        tokenizer = Tokenizer.from_dir(model_dir) if model.is_last else None
        return cls(model, EngineConfig(**config), revision=model_revision(model_dir, revision),
                   tokenizer_digest=tokenizer_digest(model_dir), tokenizer=tokenizer)

    # --- what an `EngineHost` and the services read: the same public surface as `Engine` ---------

    def has_unfinished(self) -> bool:
        """No step loop: the stage computes on commands (an `EngineHost` then just serves them)."""
        return False

    def load(self) -> EngineLoad:
        pool = self.pool
        return EngineLoad(running=len(self.jobs), waiting=0, held=0, reserved=0, free_blocks=pool.num_free,
                          used_blocks=pool.num_used, total_blocks=pool.num_blocks, evictions=pool.num_evictions)

    def limits(self) -> EngineLimits:
        c = self.model.config
        return EngineLimits(c.vocab_size, c.max_position_embeddings, self.config.block_size, c.hidden_size)

    def geometry(self) -> StageGeometry:
        c = self.model.config
        return StageGeometry(c.hidden_size, self.model.dtype, c.index_topk, self.block_offset,
                             self.layout.bytes_per_block, self.whole_block_bytes)

    @property
    def kv_buffer(self) -> torch.Tensor:
        """This stage's rows of the KV blocks (its layers' slice; staging rows included)."""
        return self.cache.buffer

    def add_block_listener(self, listener: BlockListener) -> None:
        self.pool.add_listener(listener)

    @property
    def cache_root(self) -> bytes:
        """The whole model's prefix-cache root: block hashes are the same in every stage."""
        return self.kv.root_hash or b""

    def attach_host_tier(self, write_through: bool, notify: Callable[[HostWrite], None],
                         on_drop: Callable[[], None] | None = None) -> HostOffload:
        """The host tier's engine side, as `Engine.attach_host_tier`: this stage's rows (its slice
        of each block) are written through, demoted and loaded back."""
        self.host_tier = attach_host_offload(self.kv, self.cache.buffer, self.config.host_staging_blocks,
                                             write_through, notify, on_drop)
        return self.host_tier

    def _evicted(self, block_id: int, block_hash: bytes) -> None:
        if self.host_tier is not None:
            self.host_tier.on_evict(block_id, block_hash)

    # --- a job's life -----------------------------------------------------------------------------

    def begin(self, key: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None) -> int:
        """Start a job; returns the prompt tokens this stage's pool holds (pinned until ``admit``)."""
        if key in self.jobs:
            raise ValueError(f"request_id: {key!r} is already running")
        c = self.model.config
        check_prompt(prompt_ids, params, c.vocab_size, c.max_position_embeddings)
        req = Request(key, list(prompt_ids), params, hold_blocks=True, cache_salt=cache_salt or None)
        if self.model.is_last:
            self.logits_processor.attach(req)  # ValueError naming the field (a grammar that does not compile)
        self.kv.match_prefix(req)
        self.jobs[key] = _Job(req)
        return req.num_computed

    def admit(self, key: str, num_cached: int) -> None:
        """Keep ``num_cached`` tokens of the cached prefix (a multiple of the block size, at most what
        ``begin`` found) and allocate the rest; raises `OutOfBlocks` after dropping the job."""
        job = self.jobs[key]
        req = job.request
        if num_cached % self.config.block_size or not 0 <= num_cached <= req.num_computed:
            raise ValueError(f"num_cached: {num_cached} is not a block multiple within this stage's "
                             f"{req.num_computed} cached tokens")
        keep = num_cached // self.config.block_size
        extra = req.block_ids[keep:]
        del req.block_ids[keep:], req.block_hashes[keep:]
        self.pool.release(extra[::-1])
        req.num_computed = req.mtp_synced = req.num_cached_prompt = num_cached
        if not self.kv.ensure(req, len(req.prompt_ids)):
            missing = self.kv.blocks_for(len(req.prompt_ids)) - keep
            self.abort(key)
            raise OutOfBlocks(missing, self.pool.num_free)
        job.admitted = True

    @torch.inference_mode()
    def run_chunk(self, key: str, start: int, num_tokens: int, hidden: torch.Tensor | None = None,
                  topk: torch.Tensor | None = None) -> ChunkOutput:
        """Positions ``start .. start + num_tokens - 1`` through this stage's layers. ``hidden``
        [num_tokens, H]: the previous stage's output (None on the first stage); ``topk``
        [num_tokens, k]: what the previous stage's last layer used (needed when this stage starts on
        a shared layer)."""
        job = self.jobs[key]
        req = job.request
        if not job.admitted or start != req.num_computed or not 0 < num_tokens <= len(req.prompt_ids) - start:
            raise ValueError(f"start: chunk {start}+{num_tokens} does not follow {req.num_computed} computed "
                             f"tokens of {len(req.prompt_ids)}")
        end = start + num_tokens
        batch = ForwardBatch.build([req.prompt_ids[start:end]], [start], [req.block_ids], self.config.block_size)
        out, topks = self.model(self.model.context(batch, self.cache), hidden,
                                None if topk is None else [topk])
        req.num_computed = end
        handoff = self._finish_chunk(req, start, out) if self.model.is_last else None
        self.kv.commit_full_blocks(req)
        if self.config.check_integrity:
            self.pool.check_integrity()
        return ChunkOutput(out, topks[0], handoff)

    def _finish_chunk(self, req: Request, start: int, hidden: torch.Tensor) -> PrefillOutput | None:
        """Last stage: the first token after the last chunk, and the MTP layer's KV of the chunk's
        positions (each from its normed hidden state and the token after it), as `Engine` does."""
        normed = self.model.final_norm(hidden)
        handoff = None
        if req.num_computed == len(req.prompt_ids):
            logits = self.model.logits(normed[-1:]).float()
            processed = self.logits_processor.first_token_logits(req, logits)  # grammar, bias, penalties
            sample = self.sampler.sample(processed, [req.params], [req.generator])
            token = int(sample.token_ids[0])
            req.append_output([token])
            logprob, top = _raw_logprobs(logits[0], token, req.params.logprobs)
            handoff = PrefillOutput(
                first_token=token,
                mtp_hidden=normed[-1].detach().float().contiguous().numpy().tobytes(),
                first_logprob=logprob,
                first_top_logprobs=top,
                num_cached_tokens=req.num_cached_prompt,
            )
            self.stats.prompt_tokens += len(req.prompt_ids)
        if self.use_mtp:
            tokens = req.token_ids[start + 1 : req.num_computed + 1]
            self.runner.store_mtp_kv([req], [start], [normed], [tokens])
            req.mtp_synced = req.num_computed
        return handoff

    def block_ids(self, key: str, blocks: range) -> list[int]:
        """This stage's block ids of job blocks ``blocks`` (a `kv_writes` range)."""
        return self.jobs[key].request.block_ids[blocks.start : blocks.stop]

    def num_cached(self, key: str) -> int:
        return self.jobs[key].request.num_cached_prompt

    def release(self, key: str) -> bool:
        """End a job whose writes are final: its full blocks stay cached, the rest is freed."""
        job = self.jobs.pop(key, None)
        if job is None:
            return False
        self.kv.commit_full_blocks(job.request)
        self.kv.free(job.request)
        return True

    def abort(self, key: str) -> bool:
        """Drop a job now (only once nothing may still read or write its blocks)."""
        job = self.jobs.pop(key, None)
        if job is None:
            return False
        self.kv.free(job.request)
        return True


def _raw_logprobs(logits: torch.Tensor, token: int, n: int | None) -> tuple[float | None, list[tuple[int, float]]]:
    """The chosen token's logprob and the ``n`` most likely (id, logprob) under the model's own
    distribution (before grammar, bias or penalties), as `Engine` reports them; None / [] unasked."""
    if n is None:
        return None, []
    row = torch.log_softmax(logits.float(), dim=-1)
    top = row.topk(n) if n else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
    return float(row[token]), pairs
