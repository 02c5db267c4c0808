"""Engine: continuous batching of GLM-5 requests over the paged KV pool, with MTP speculative decoding.

One `step()` = schedule, one main-model forward (prefill chunks and decode verification together),
sample / verify, then MTP drafting for the next step. The engine is synchronous and transport-free;
services drive it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from glmserve.core.generation import SamplingParams, TokenEvent
from glmserve.core.stop_checker import StopChecker
from glmserve.engine.engine_stats import EngineStats
from glmserve.engine.host_offload import HostOffload, HostWrite
from glmserve.engine.kv_cache_manager import KVCacheManager, prefix_cache_root
from glmserve.engine.model_runner import ModelRunner
from glmserve.engine.rejection_sampler import verify
from glmserve.engine.request import Request, RequestStatus
from glmserve.engine.sampler import Sampler, processed_probs
from glmserve.engine.scheduler import ScheduledWork, Scheduler, SchedulerConfig
from glmserve.engine.spec_policy import SpecPolicy
from glmserve.kv.block_pool import BlockPool
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.kv_layout import KVLayout
from glmserve.model.loader import load_model
from glmserve.model.mtp_draft import extend_shared_topk
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.revision import model_revision
from glmserve.text.detokenizer import IncrementalDetokenizer
from glmserve.text.tokenizer import Tokenizer
from glmserve.text.tokenizer_digest import tokenizer_digest as tokenizer_files_digest

log = logging.getLogger(__name__)
# Decode positions an idle MTP layer may fall behind before its KV gets a hole (bounded memory).
MAX_PENDING_MTP_ROWS = 256


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 64
    kv_cache_bytes: int = 256 * 2**20
    max_num_seqs: int = 64
    max_step_tokens: int = 2048
    mtp: str | int = "auto"  # "auto" (adaptive k), "off", or a fixed number of drafts
    max_drafts: int = 3
    prefix_caching: bool = True
    host_staging_blocks: int = 0  # extra cache rows for demoting evicted blocks to the host tier
    check_integrity: bool = False  # check the block pool after every step (tests; O(num_blocks))

    def __post_init__(self) -> None:
        if self.mtp not in ("auto", "off") and not (isinstance(self.mtp, int) and self.mtp >= 0):
            raise ValueError(f"mtp: {self.mtp!r} is not 'auto', 'off' or a number of drafts >= 0")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes: must be > 0")
        if self.host_staging_blocks < 0:
            raise ValueError(f"host_staging_blocks: must be >= 0, got {self.host_staging_blocks}")


class Engine:
    def __init__(
        self,
        model: GlmForCausalLM,
        config: EngineConfig = EngineConfig(),
        revision: str = "",
        tokenizer: Tokenizer | None = None,
        tokenizer_digest: str | None = None,
    ):
        """``revision`` / ``tokenizer_digest`` enter the prefix-cache root, so KV is only reused for
        the same weights and token meaning (``from_model_dir`` computes both from the files)."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.eos_ids = tuple(model.config.eos_token_ids)
        use_mtp = model.has_mtp and config.mtp != "off"
        layout = KVLayout.for_config(model.config, config.block_size, dtype=model.dtype, with_mtp=use_mtp)
        num_blocks = config.kv_cache_bytes // layout.bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_bytes: {config.kv_cache_bytes} B holds fewer than 2 blocks")
        log.info("%s; %d blocks (%d tokens)", layout.describe(), num_blocks, num_blocks * config.block_size)
        # Rows past the pool's blocks are staging rows for demotion (HostOffload); the model never sees them.
        self.cache = PagedKVCache(layout, num_blocks + config.host_staging_blocks)
        self.pool = BlockPool(num_blocks, on_evict=self._evicted)
        self.host: HostOffload | None = None
        root = prefix_cache_root(model.dtype, config, revision, tokenizer_digest) if config.prefix_caching else None
        self.kv = KVCacheManager(self.pool, config.block_size, root)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_step_tokens), self.kv)
        self.runner = ModelRunner(model, self.cache)
        self.sampler = Sampler()
        max_drafts = 0 if not use_mtp else (config.max_drafts if config.mtp == "auto" else int(config.mtp))
        self.policy = SpecPolicy(max_drafts)
        self.fixed_drafts = None if config.mtp == "auto" else max_drafts
        self.use_mtp = use_mtp
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # finished, blocks kept (prefill-only requests)
        self.reserved: dict[str, list[int]] = {}  # blocks allocated for KV that another worker writes
        self.stats = EngineStats()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                       revision: str | None = None, **config) -> Engine:
        """``revision``: an explicit model revision (else the digest of the checkpoint files)."""
        model = load_model(model_dir, dtype=dtype)
        tokenizer = Tokenizer.from_dir(model_dir)
        return cls(model, EngineConfig(**config), revision=model_revision(model_dir, revision),
                   tokenizer=tokenizer, tokenizer_digest=tokenizer_files_digest(model_dir))

    # --- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        hold_blocks: bool = False,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request. `hold_blocks` (prefill workers): when it finishes, its blocks stay allocated
        and `held[request_id]` keeps it, with `last_hidden` set, until `release(request_id)`.
        `cache_salt`: the tenant's prefix-cache salt (only requests with the same salt share KV)."""
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if len(prompt_ids) + params.max_tokens > self.model.config.max_position_embeddings:
            raise ValueError("prompt_ids: prompt plus max_tokens exceeds max_position_embeddings")
        bad = [t for t in prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: token ids out of range: {bad[:5]}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need an engine with a tokenizer")
        req = Request(request_id, list(prompt_ids), params, priority=priority, hold_blocks=hold_blocks,
                      cache_salt=cache_salt or None)
        req.stop_checker = StopChecker(params, self.eos_ids)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its blocks are free when this returns."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return self.release(request_id)
        self.scheduler.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
        self.stats.aborts += 1
        return True

    # --- host tier ------------------------------------------------------------------------------

    def attach_host(self, write_through: bool, notify: Callable[[HostWrite], None],
                    on_drop: Callable[[], None] | None = None) -> HostOffload:
        """Turn on the host tier's engine side (see `HostOffload`); ``notify`` gets each write and
        ``on_drop`` each eviction not demoted, on this engine's thread. Needs prefix caching (host
        blocks are found by hash)."""
        if self.kv.root_hash is None:
            raise ValueError("prefix_caching: the host tier needs prefix caching on")
        self.host = HostOffload(self.pool, self.cache.buffer, self.config.host_staging_blocks,
                                write_through=write_through, notify=notify, on_drop=on_drop)
        self.kv.on_free = self.host.on_free
        return self.host

    def _evicted(self, block_id: int, block_hash: bytes) -> None:
        if self.host is not None:
            self.host.on_evict(block_id, block_hash)

    # --- disaggregation: blocks that outlive a request, or arrive from another worker ------------

    def release(self, request_id: str) -> bool:
        """Free what a held (prefill-only) request or a reservation kept."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.commit_full_blocks(req)
            self.kv.free(req)
            return True
        blocks = self.reserved.pop(request_id, None)
        if blocks is not None:
            self.pool.release(blocks[::-1])
            return True
        return False

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocate blocks for `num_tokens` positions that a prefill worker will write into.

        They are owned by the incoming transfer until `add_prefilled` (or `release` after the writer
        has drained). Raises OutOfBlocks when the pool cannot hold them."""
        if request_id in self.reserved or request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} already has blocks")
        blocks = self.pool.allocate(self.kv.blocks_for(num_tokens))
        self.reserved[request_id] = blocks
        return blocks

    def add_prefilled(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, first_token: int,
        last_hidden: torch.Tensor, num_cached: int = 0, cache_salt: str | None = None,
    ) -> TokenEvent:
        """Continue a request whose prompt KV (main and MTP layers) is in its reserved blocks.

        `last_hidden` is the prefill worker's normed hidden state at the last prompt position: with the
        first token it seeds MTP drafting. Returns the first token's output (it may already finish)."""
        blocks = self.reserved.pop(request_id)
        req = Request(request_id, list(prompt_ids), params, cache_salt=cache_salt or None)
        req.stop_checker = StopChecker(params, self.eos_ids)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        req.block_ids = blocks
        req.num_computed = len(prompt_ids)
        req.mtp_synced = len(prompt_ids) - 1
        req.num_cached_prompt = num_cached
        self.requests[request_id] = req
        self.scheduler.adopt(req)
        self.kv.commit_full_blocks(req)
        out = self._emit(req, [first_token], None)
        if not req.is_finished and self.use_mtp and self.kv.ensure(req, req.num_computed + 1):
            self._draft([(req, req.num_computed - 1, last_hidden.reshape(1, -1), False)])
        return out

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- one step -------------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One step (see the module docstring); an event for every request that gained tokens or finished."""
        work = self.scheduler.schedule()
        if not work:
            return []
        self.stats.steps += 1
        t0 = time.perf_counter()
        draft_counts = {len(w.request.drafts) for w in work if w.is_decode}
        pure_decode = all(w.is_decode for w in work) and len(draft_counts) == 1
        main = self.runner.run_main(work)
        verified = self._verify(work, main.logits)
        outputs, to_draft, gained = [], [], 0
        for i, w in enumerate(work):
            req, start, was_decode = w.request, w.request.num_computed, w.is_decode
            new_tokens = self._advance(w, main.logits[i], verified.get(i))
            gained += len(new_tokens)
            if not was_decode and main.logits[i] is not None:
                req.last_hidden = main.hidden[i][-1].clone()
            self.kv.commit_full_blocks(req)  # before a finish frees the blocks
            out = self._emit(req, new_tokens, main.logits[i])
            if out.token_ids or out.finished:
                outputs.append(out)
            if req.is_finished and not (req.hold_blocks and not was_decode):
                continue  # a held prefill still gets its MTP KV: decode drafts from it
            if self.use_mtp:
                to_draft.append((req, start, main.hidden[i], was_decode))
        t_forward = time.perf_counter()
        drafted = self._draft(to_draft) if to_draft else None
        if pure_decode:  # the policy learns what verifying and drafting each cost in such steps
            self.policy.record_step(len(work), draft_counts.pop(), t_forward - t0, gained)
            if drafted is not None:
                self.policy.record_drafting(len(work), drafted, time.perf_counter() - t_forward)
        self.stats.preemptions = self.scheduler.num_preemptions
        if self.config.check_integrity:
            self.pool.check_integrity()
        return outputs

    def _verify(self, work: list[ScheduledWork], logits: list[torch.Tensor | None]) -> dict[int, list[int]]:
        """Tokens each decode item gains (accepted drafts + one), verified in one batch per draft
        length: one argmax and one transfer to Python for the whole batch instead of per request."""
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, w in enumerate(work):
            if w.is_decode:
                groups.setdefault((len(w.request.drafts), w.request.draft_probs is not None), []).append(i)
        out: dict[int, list[int]] = {}
        for (k, has_probs), items in groups.items():
            reqs = [work[i].request for i in items]
            drafts = torch.tensor([r.drafts for r in reqs], dtype=torch.int64).view(len(reqs), k)
            probs = torch.stack([r.draft_probs for r in reqs]) if has_probs else None
            result = verify(drafts, probs, torch.stack([logits[i] for i in items]),
                            [r.params for r in reqs], [r.generator for r in reqs])
            out.update(zip(items, result.accepted, strict=True))
        return out

    def _advance(self, w: ScheduledWork, logits: torch.Tensor | None, verified: list[int] | None) -> list[int]:
        """Move the request past this step's forward; returns the tokens it gained (`verified`: what
        verification gave a decode item)."""
        req = w.request
        if verified is None:
            req.num_computed += w.num_new
            self.stats.prompt_tokens += w.num_new
            if logits is None:
                return []
            self.stats.cached_prompt_tokens += req.num_cached_prompt
            sample = self.sampler.sample(logits, [req.params], [req.generator])
            return [int(sample.token_ids[0])]
        drafts, tokens = req.drafts, verified
        req.num_computed += len(tokens)  # the pending token and the accepted drafts now have KV
        req.drafts, req.draft_probs = [], None
        if drafts:
            self.stats.draft_tokens += len(drafts)
            self.stats.accepted_tokens += len(tokens) - 1
            self.stats.draft_lengths[len(drafts)] += 1
        self.stats.acceptance_lengths[len(tokens)] += 1
        self.kv.trim(req, req.num_computed + 1)
        return tokens

    def _emit(self, req: Request, tokens: list[int], logits: torch.Tensor | None) -> TokenEvent:
        """Append tokens up to the first stop; finish the request when it is done."""
        check = req.stop_checker.check_tokens(tokens) if tokens else None
        kept = tokens[: check.num_kept] if check else []
        if kept and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        logprobs, top_logprobs = self._logprobs(req, kept, logits)
        req.output_ids.extend(kept)
        req.output_logprobs.extend(logprobs)
        req.output_top_logprobs.extend(top_logprobs)
        self.stats.generated_tokens += len(kept)
        text_delta = self._text(req, kept[: check.num_visible] if check else [])
        reason = req.stop_checker.finish_reason
        if reason is not None:
            self._finish(req, reason)
        return TokenEvent(req.request_id, kept, text_delta, logprobs, top_logprobs, reason,
                          req.stop_checker.stop_reason if reason is not None else None, req.num_cached_prompt)

    def _text(self, req: Request, visible: list[int]) -> str:
        """New text safe to stream; stop strings end the request and cut the text before them."""
        if req.detokenizer is None:
            return ""
        req.text += req.detokenizer.push(visible)
        if req.stop_checker.finished:
            req.text += req.detokenizer.finish()
        end = len(req.text)
        if req.params.stop:
            result = req.stop_checker.check_text(req.text)
            req.text = req.text[: result.text_end]
            end = result.stream_end
        delta = req.text[req.num_streamed_chars : end]
        req.num_streamed_chars = max(req.num_streamed_chars, end)
        return delta

    def _logprobs(
        self, req: Request, tokens: list[int], logits: torch.Tensor | None
    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Logprob of each kept token under the model's raw distribution, and the top-N alternatives."""
        n = req.params.logprobs
        if n is None or not tokens or logits is None:
            return [], []
        rows = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
        chosen = [float(rows[i, t]) for i, t in enumerate(tokens)]
        if n == 0:
            return chosen, []
        top = rows.topk(n, dim=-1)
        pairs = [list(zip(ids.tolist(), vals.tolist(), strict=True)) for vals, ids in zip(top.values, top.indices, strict=True)]
        return chosen, pairs

    def _finish(self, req: Request, reason: str) -> None:
        self.scheduler.remove(req, free_blocks=not req.hold_blocks)
        self.requests.pop(req.request_id, None)
        if req.hold_blocks:
            self.held[req.request_id] = req
        req.status, req.finish_reason = RequestStatus.FINISHED, reason

    # --- MTP drafting ---------------------------------------------------------------------------

    def _draft(self, items: list[tuple[Request, int, torch.Tensor, bool]]) -> int:
        """Bring each request's MTP KV up to date with this step's hidden states, then draft;
        returns the number of drafts chosen.

        Prompt positions always get MTP KV (later drafts attend to them). Decode steps that want no
        drafts keep their hidden rows pending instead, and the next drafting step runs them all, so
        switching speculation off and on leaves no hole in the MTP layer's KV."""
        decoding = [r for r, _, _, _ in items if not r.in_prefill and not r.is_finished]
        k = self.fixed_drafts
        if k is None:  # only pure decode steps are measured: no exploring while prompts still run
            steady = not self.scheduler.num_waiting and not any(r.in_prefill for r in self.scheduler.running)
            k = self.policy.choose(len(decoding), measurable=steady)
        reqs, starts, hidden, next_tokens = [], [], [], []
        for req, start, rows, was_decode in items:
            if was_decode and k == 0:
                self._defer_mtp(req, start, rows)
                continue
            pending = req.mtp_pending  # covers positions mtp_synced .. start - 1 when not empty
            first = req.mtp_synced if pending else max(req.mtp_synced, start)
            reqs.append(req)
            starts.append(first)
            hidden.append(torch.cat([*pending, rows[max(first, start) - start : req.num_computed - start]]))
            next_tokens.append(req.token_ids[first + 1 : req.num_computed + 1])
            req.mtp_synced, req.mtp_pending = req.num_computed, []
        if not reqs:
            return k
        if k == 0:  # no draft wanted: the MTP layer's KV is all that is needed
            self.runner.store_mtp_kv(reqs, starts, hidden, next_tokens)
            return k
        result = self.runner.run_mtp(reqs, starts, hidden, next_tokens)
        picks = [
            i for i, r in enumerate(reqs)
            if not r.in_prefill and not r.is_finished and self.kv.ensure(r, r.num_computed + k + 1)
        ]
        self._draft_steps([reqs[i] for i in picks], result.hidden[picks], result.logits[picks],
                          [result.topk[i] for i in picks], k)
        return k

    @staticmethod
    def _defer_mtp(req: Request, start: int, rows: torch.Tensor) -> None:
        """Keep this step's hidden rows for the MTP layer until drafting resumes (bounded)."""
        if req.mtp_synced < start and not req.mtp_pending:
            req.mtp_synced = start  # an older hole stays (rows dropped at the cap below)
        req.mtp_pending.append(rows[: req.num_computed - start])
        if req.num_computed - req.mtp_synced > MAX_PENDING_MTP_ROWS:
            req.mtp_synced, req.mtp_pending = req.num_computed, []

    def _draft_steps(self, reqs, hidden, logits, topk, k: int) -> None:
        if not reqs:
            return
        for j in range(k):
            for i, req in enumerate(reqs):
                token, q = self._propose(req, logits[i])
                req.drafts.append(token)
                if q is not None:
                    req.draft_probs = q[None] if req.draft_probs is None else torch.cat([req.draft_probs, q[None]])
            if j == k - 1:
                return
            positions = [r.num_computed + j for r in reqs]
            shared = None
            if self.model.config.index_share_for_mtp_iteration:
                shared = [extend_shared_topk(t, r.num_computed - 1, j + 1) for t, r in zip(topk, reqs, strict=True)]
            result = self.runner.run_mtp(reqs, positions, list(hidden.split(1)), [[r.drafts[-1]] for r in reqs], shared)
            hidden, logits = result.hidden, result.logits
            if not self.model.config.index_share_for_mtp_iteration:
                topk = result.topk

    def _propose(self, req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if req.params.is_greedy:
            return int(logits.argmax()), None
        q = processed_probs(logits[None], [req.params])[0]
        return int(torch.multinomial(q, 1, generator=req.generator)), q

    # --- convenience ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Run prompts to completion (all batched together); returns the finished requests in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        base = self.stats.steps
        reqs = [self.add_request(f"gen-{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        while self.has_unfinished():
            self.step()
        return reqs
