"""Engine: continuous batching of GLM-5 requests over the paged KV pool, with MTP speculative decoding.

One `step()` = schedule, one main-model forward (prefill chunks and decode verification together),
sample / verify, text and stop checks (`OutputText`), then MTP drafting for the next step
(`MTPDrafter`). The engine is synchronous, single-threaded and transport-free; services host it on
an `EngineHost` thread and use only this surface:

- requests: ``add_request``, ``abort``, ``abort_all``, ``step() -> list[TokenEvent]``,
  ``has_unfinished``, ``generate`` (a convenience for scripts and tests);
- disaggregation, with typed records (`glmserve.engine.handoff`): prefill side ``add_request(...,
  hold_blocks=True)``, ``held_prefill(rid) -> HeldPrefill``, ``release``; decode side ``reserve``,
  ``add_prefilled(rid, prompt, params, PrefillOutput)``, ``release``; ``kv_buffer`` is the memory
  transfers write into;
- state for Health and metrics: ``load() -> EngineLoad``, ``limits() -> EngineLimits``, ``stats``,
  ``cache_root``; the prefix-cache index feed ``add_block_listener``; the CPU KV tier
  ``attach_host_tier`` / ``host_tier``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from glmserve.core.generation import SamplingParams, TokenEvent, check_prompt
from glmserve.core.stop_checker import StopChecker
from glmserve.engine.engine_config import EngineConfig
from glmserve.engine.engine_stats import EngineLimits, EngineLoad, EngineStats
from glmserve.engine.handoff import HeldPrefill, PrefillOutput
from glmserve.engine.host_offload import HostOffload, HostWrite, attach_host_offload
from glmserve.engine.kv_cache_manager import KVCacheManager, prefix_cache_root
from glmserve.engine.logits_processor import LogitsProcessor
from glmserve.engine.model_runner import ModelRunner
from glmserve.engine.mtp_drafter import MTPDrafter
from glmserve.engine.rejection_sampler import verify
from glmserve.engine.request import Request, RequestStatus
from glmserve.engine.sampler import Sampler
from glmserve.engine.scheduler import ScheduledWork, Scheduler, SchedulerConfig
from glmserve.kv.block_pool import BlockListener, BlockPool
from glmserve.model.dtype_choice import resolve_dtype
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.kv_layout import KVLayout
from glmserve.model.loader import load_model
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.revision import model_revision
from glmserve.text.output_text import OutputText
from glmserve.text.tokenizer import Tokenizer
from glmserve.text.tokenizer_digest import tokenizer_digest as tokenizer_files_digest

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: GlmForCausalLM,
        config: EngineConfig | None = None,
        revision: str = "",
        tokenizer: Tokenizer | None = None,
        tokenizer_digest: str | None = None,
        grammars=None,
    ):
        """``revision`` / ``tokenizer_digest`` enter the prefix-cache root, so KV is only reused for
        the same weights and token meaning (``from_model_dir`` computes both from the files).
        ``grammars``: a compiled-grammar cache to share (`GrammarCache` of the same tokenizer)."""
        config = config or EngineConfig()
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
        self.host_tier: HostOffload | None = None  # the CPU KV tier's engine side, once attached
        root = prefix_cache_root(model.dtype, config, revision, tokenizer_digest) if config.prefix_caching else None
        self.kv = KVCacheManager(self.pool, config.block_size, root)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_step_tokens, config.max_shared_prompt_tokens), self.kv)
        self.runner = ModelRunner(model, self.cache)
        self.sampler = Sampler()
        self.logits_processor = LogitsProcessor(tokenizer, model.config.vocab_size, grammars)
        self.drafter: MTPDrafter | None = None
        if use_mtp:
            max_drafts = config.max_drafts if config.mtp == "auto" else int(config.mtp)
            self.drafter = MTPDrafter(self.runner, self.kv, self.scheduler, max_drafts,
                                      None if config.mtp == "auto" else max_drafts,
                                      model.config.index_share_for_mtp_iteration, self.logits_processor)
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # finished, blocks kept (prefill-only requests)
        self.reserved: dict[str, list[int]] = {}  # blocks allocated for KV that another worker writes
        self.stats = EngineStats()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: torch.dtype | str = "auto",
                       revision: str | None = None, **config) -> Engine:
        """``revision``: an explicit model revision (else the digest of the checkpoint files);
        ``dtype`` "auto": bfloat16 where the CPU has AMX or AVX512-BF16, else float32 (`resolve_dtype`)."""
        model = load_model(model_dir, dtype=resolve_dtype(dtype))
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
        and `held_prefill(request_id)` says what it kept, until `release(request_id)`.
        `cache_salt`: the tenant's prefix-cache salt (only requests with the same salt share KV)."""
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"request_id: {request_id!r} is already running")
        c = self.model.config
        check_prompt(prompt_ids, params, c.vocab_size, c.max_position_embeddings)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need an engine with a tokenizer")
        req = self._new_request(request_id, prompt_ids, params, cache_salt, priority=priority,
                                hold_blocks=hold_blocks)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     cache_salt: str | None, **fields) -> Request:
        req = Request(request_id, list(prompt_ids), params, cache_salt=cache_salt or None, **fields)
        self.logits_processor.attach(req)  # ValueError naming the field: nothing is kept
        req.stop_checker = StopChecker(params, self.eos_ids)
        if self.tokenizer is not None:
            req.output_text = OutputText(self.tokenizer, params, req.stop_checker)
            if params.num_resumed:  # a migrated stream: its text so far was sent already
                req.output_text.resume(req.prompt_ids[-params.num_resumed:])
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

    def abort_all(self) -> list[str]:
        """Abort every running or waiting request (a failed step); returns their ids."""
        ids = list(self.requests)
        for request_id in ids:
            self.abort(request_id)
        return ids

    # --- host tier ------------------------------------------------------------------------------

    def attach_host_tier(self, write_through: bool, notify: Callable[[HostWrite], None],
                    on_drop: Callable[[], None] | None = None) -> HostOffload:
        """Turn on the host tier's engine side (see `HostOffload`); ``notify`` gets each write and
        ``on_drop`` each eviction not demoted, on this engine's thread. Needs prefix caching (host
        blocks are found by hash)."""
        self.host_tier = attach_host_offload(self.kv, self.cache.buffer, self.config.host_staging_blocks,
                                             write_through, notify, on_drop)
        return self.host_tier

    def _evicted(self, block_id: int, block_hash: bytes) -> None:
        if self.host_tier is not None:
            self.host_tier.on_evict(block_id, block_hash)

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

    def held_prefill(self, request_id: str) -> HeldPrefill:
        """What a finished prefill-only request kept (its blocks stay owned until `release`)."""
        req = self.held[request_id]
        output = PrefillOutput(
            first_token=req.output_ids[0],
            mtp_hidden=req.last_hidden.detach().float().contiguous().numpy().tobytes(),
            first_logprob=req.output_logprobs[0] if req.output_logprobs else None,
            first_top_logprobs=req.output_top_logprobs[0] if req.output_top_logprobs else [],
            num_cached_tokens=req.num_cached_prompt,
        )
        timed = req.scheduled_time is not None and req.first_token_time is not None
        return HeldPrefill(
            list(req.block_ids), output,
            queue_s=req.scheduled_time - req.arrival if timed else None,
            compute_s=req.first_token_time - req.scheduled_time if timed else None,
        )

    def add_prefilled(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      prefilled: PrefillOutput, cache_salt: str | None = None) -> TokenEvent:
        """Continue a request whose prompt KV (main and MTP layers) is in its reserved blocks.

        Returns the first token's event (it may already finish). Raises ``ValueError`` (the
        reservation stays) when ``prefilled.mtp_hidden`` does not fit this model or the sampling
        parameters cannot apply here (a grammar that does not compile)."""
        hidden_size = self.model.config.hidden_size
        if len(prefilled.mtp_hidden) != 4 * hidden_size:
            raise ValueError(f"mtp_hidden: {len(prefilled.mtp_hidden)} bytes, expected float32 [{hidden_size}]")
        last_hidden = torch.frombuffer(bytearray(prefilled.mtp_hidden), dtype=torch.float32).to(self.model.dtype)
        req = self._new_request(request_id, prompt_ids, params, cache_salt)
        blocks = self.reserved.pop(request_id)
        req.block_ids = blocks
        req.num_computed = len(prompt_ids)
        req.mtp_synced = len(prompt_ids) - 1
        req.num_cached_prompt = prefilled.num_cached_tokens
        self.requests[request_id] = req
        self.scheduler.adopt(req)
        self.kv.commit_full_blocks(req)
        out = self._emit(req, [prefilled.first_token], None, prefilled)
        if not req.is_finished and self.drafter is not None and self.kv.ensure(req, req.num_computed + 1):
            self.drafter.draft([(req, req.num_computed - 1, last_hidden.reshape(1, -1), False)])
        return out

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self.scheduler.running), waiting=self.scheduler.num_waiting, held=len(self.held),
            reserved=len(self.reserved), free_blocks=self.pool.num_free, used_blocks=self.pool.num_used,
            total_blocks=self.pool.num_blocks, evictions=self.pool.num_evictions,
        )

    def limits(self) -> EngineLimits:
        c = self.model.config
        return EngineLimits(c.vocab_size, c.max_position_embeddings, self.config.block_size, c.hidden_size)

    @property
    def kv_buffer(self) -> torch.Tensor:
        """The paged KV cache's memory, one row per block: what transfer backends register and
        write into (staging rows for the host tier included)."""
        return self.cache.buffer

    def add_block_listener(self, listener: BlockListener) -> None:
        """Tell ``listener`` about every block cached or evicted (the kvstore index's feed)."""
        self.pool.add_listener(listener)

    @property
    def cache_root(self) -> bytes:
        """The prefix-cache root hash (empty: caching off); routers hash prompts with it."""
        return self.kv.root_hash or b""

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
        logits = self.logits_processor.adjust(work, main.logits)  # grammar, bias, penalties (a copy)
        verified = self._verify(work, logits)
        outputs, to_draft, gained = [], [], 0
        for i, w in enumerate(work):
            req, start, was_decode = w.request, w.request.num_computed, w.is_decode
            new_tokens = self._advance(w, logits[i], verified.get(i))
            gained += len(new_tokens)
            if not was_decode and main.logits[i] is not None:
                req.last_hidden = main.hidden[i][-1].clone()
            self.kv.commit_full_blocks(req)  # before a finish frees the blocks
            out = self._emit(req, new_tokens, main.logits[i])
            if out.token_ids or out.finished:
                outputs.append(out)
            if req.is_finished and not (req.hold_blocks and not was_decode):
                continue  # a held prefill still gets its MTP KV: decode drafts from it
            if self.drafter is not None:
                to_draft.append((req, start, main.hidden[i], was_decode))
        t_forward = time.perf_counter()
        drafted = self.drafter.draft(to_draft) if to_draft else None
        if pure_decode and self.drafter is not None:  # the policy learns what such steps cost
            self.drafter.learn(len(work), draft_counts.pop(), t_forward - t0, gained, drafted,
                               time.perf_counter() - t_forward)
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

    def _emit(self, req: Request, tokens: list[int], logits: torch.Tensor | None,
              prefilled: PrefillOutput | None = None) -> TokenEvent:
        """Append tokens up to the first stop; finish the request when it is done. The logprobs
        come from ``logits``, or for a prefilled first token from ``prefilled``."""
        check = req.stop_checker.check_tokens(tokens) if tokens else None
        kept = tokens[: check.num_kept] if check else []
        if kept and req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if prefilled is not None and req.params.logprobs is not None and prefilled.first_logprob is not None:
            logprobs = [prefilled.first_logprob]
            top_logprobs = [list(prefilled.first_top_logprobs)] if req.params.logprobs else []
        else:
            logprobs, top_logprobs = self._logprobs(req, kept, logits)
        self.logits_processor.kept(req, kept)
        req.append_output(kept)
        req.output_logprobs.extend(logprobs)
        req.output_top_logprobs.extend(top_logprobs)
        self.stats.generated_tokens += len(kept)
        visible = kept[: check.num_visible] if check else []
        text = req.output_text.push(visible) if req.output_text is not None else ""
        reason = req.stop_checker.finish_reason
        if reason is not None:
            self._finish(req, reason)
        stop_reason = req.stop_checker.stop_reason if reason is not None else None
        return TokenEvent(req.request_id, kept, text, logprobs, top_logprobs, reason, stop_reason,
                          req.num_cached_prompt)

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

    # --- convenience ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Run prompts to completion (all batched together); returns the finished requests in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        base = self.stats.steps
        reqs = [self.add_request(f"gen-{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        while self.has_unfinished():
            self.step()
        return reqs
