"""ModelRunner: turns scheduled work into forward passes of the main model and of the MTP layer.

An engine step is one `run_main`, then any number of `run_mtp` calls (drafting). The graph weights
are checked for changed parameters once per step, at its first `decode` or `mtp_decode` call,
not at every call: the check reads each parameter's version, and nothing changes weights
within a step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmserve.engine.request import Request
from glmserve.engine.scheduler import ScheduledWork
from glmserve.model.attention import pad_topk, split_topk
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.graph_weights import GraphWeights
from glmserve.model.paged_cache import PagedKVCache

# Items with more MTP positions than this store the KV of all but the last without running the layer.
KV_ONLY_MIN_POSITIONS = 8


@dataclass
class MainResult:
    hidden: list[torch.Tensor]  # per work item: normed hidden states [num_new, H]
    logits: list[torch.Tensor | None]  # per work item: [rows, V] (decode: all rows; final prefill: last row)


@dataclass
class MtpResult:
    hidden: torch.Tensor  # [B, H] MTP output at each item's last position
    logits: torch.Tensor  # [B, V] draft logits of the token after the item's last input token
    topk: list[torch.Tensor]  # per item: [1, k] top-k the MTP indexer chose for the last position


class ModelRunner:
    def __init__(self, model: GlmForCausalLM, cache: PagedKVCache):
        self.model = model
        self.cache = cache
        self.block_size = cache.layout.block_size
        self._step_weights: GraphWeights | None = None  # taken by this step's first graph call

    def _graph_weights(self) -> GraphWeights:
        if self._step_weights is None:
            self._step_weights = self.model.graph_weights()
        return self._step_weights

    def _batch(self, tokens: list[list[int]], starts: list[int], reqs: list[Request]) -> ForwardBatch:
        return ForwardBatch.build(tokens, starts, [r.block_ids for r in reqs], self.block_size)

    @torch.inference_mode()
    def run_main(self, work: list[ScheduledWork]) -> MainResult:
        """The main model over this step's work: decode items (the pending token and its drafts) through
        `GlmForCausalLM.decode`, one pass per length, the rest (prompt chunks) through its layers."""
        self._step_weights = None  # a new step: weights may have changed since the last one
        result = MainResult([None] * len(work), [None] * len(work))  # type: ignore[list-item]
        by_len: dict[int, list[int]] = {}
        general = []
        for i, w in enumerate(work):
            if w.is_decode and self.model.decodes_queries(w.num_new):
                by_len.setdefault(w.num_new, []).append(i)
            else:
                general.append(i)
        for items in by_len.values():
            self._run_graph(work, items, result)
        if general:
            self._run_model(work, general, result)
        return result

    def _run_graph(self, work: list[ScheduledWork], items: list[int], result: MainResult) -> None:
        """Decode items of one length S in one `decode` pass."""
        reqs = [work[i].request for i in items]
        s = work[items[0]].num_new
        ids = torch.tensor([[r.token_ids[-1], *r.drafts][:s] for r in reqs], dtype=torch.int64)
        positions = torch.tensor([r.num_computed for r in reqs], dtype=torch.int64)[:, None] + torch.arange(s)
        logits, normed = self.model.decode(self.cache, ids, positions, _tables(reqs), self._graph_weights())
        for j, i in enumerate(items):
            result.hidden[i] = normed[j * s : (j + 1) * s]
            result.logits[i] = logits[j * s : (j + 1) * s]

    def _run_model(self, work: list[ScheduledWork], items: list[int], result: MainResult) -> None:
        """Work items through the model layer by layer (prompt chunks; decode where `decode` cannot run)."""
        tokens, starts, reqs = [], [], []
        for i in items:
            w = work[i]
            r = w.request
            if w.is_decode:
                tokens.append([r.token_ids[-1], *r.drafts][: w.num_new])
            else:
                tokens.append(r.token_ids[r.num_computed : r.num_computed + w.num_new])
            starts.append(r.num_computed)
            reqs.append(r)
        batch = self._batch(tokens, starts, reqs)
        hidden, _ = self.model(self.model.context(batch, self.cache))
        normed = self.model.final_norm(hidden)
        per_item = list(normed.split([len(t) for t in tokens]))
        rows, owners = [], []
        for i, hidden_i in zip(items, per_item, strict=True):
            result.hidden[i] = hidden_i
            w = work[i]
            r = w.request
            if w.is_decode:
                rows.append(hidden_i)
                owners.append(i)
            elif r.num_computed + w.num_new == len(r.prompt_ids) and not r.output_ids:
                rows.append(hidden_i[-1:])
                owners.append(i)
        if rows:
            for i, chunk in zip(owners, self.model.logits(torch.cat(rows)).split([len(x) for x in rows]), strict=True):
                result.logits[i] = chunk.float()

    @torch.inference_mode()
    def store_mtp_kv(
        self, reqs: list[Request], starts: list[int], hidden: list[torch.Tensor], next_tokens: list[list[int]]
    ) -> None:
        """Only the MTP layer's KV at those positions (inputs as in `run_mtp`), no outputs."""
        batch = self._batch(next_tokens, starts, reqs)
        self.model.mtp_step_kv(self.model.context(batch, self.cache), torch.cat(hidden))

    @torch.inference_mode()
    def run_mtp(
        self,
        reqs: list[Request],
        starts: list[int],
        hidden: list[torch.Tensor],
        next_tokens: list[list[int]],
        topk_in: list[torch.Tensor] | None = None,
    ) -> MtpResult:
        """MTP over positions starts[i] .. starts[i] + len(next_tokens[i]) - 1 of each request: the
        inputs are the hidden state at each position and the token after it.

        Only each request's last position needs an output (the next draft). For items with many
        positions (prompt chunks, caught-up decode steps) the others only get their KV stored, which
        costs a fraction of the whole layer; a few positions go through the layer in one pass."""
        kv_rows = [len(t) - 1 if len(t) > KV_ONLY_MIN_POSITIONS else 0 for t in next_tokens]
        if any(kv_rows):
            keep = [i for i, n in enumerate(kv_rows) if n]
            self.store_mtp_kv([reqs[i] for i in keep], [starts[i] for i in keep],
                              [hidden[i][: kv_rows[i]] for i in keep], [next_tokens[i][: kv_rows[i]] for i in keep])
        tokens = [t[n:] for t, n in zip(next_tokens, kv_rows, strict=True)]
        starts = [s + n for s, n in zip(starts, kv_rows, strict=True)]
        hidden = [h[n:] for h, n in zip(hidden, kv_rows, strict=True)]
        if self.model.decodes_queries(max(len(t) for t in tokens)):
            return self._mtp_graph(reqs, starts, hidden, tokens, topk_in)
        batch = self._batch(tokens, starts, reqs)
        out, topks = self.model.mtp_step(self.model.context(batch, self.cache), torch.cat(hidden), topk_in)
        last = out[torch.tensor([len(t) for t in tokens]).cumsum(0) - 1]
        return MtpResult(last, self.model.mtp_logits(last).float(), [k[-1:] for k in topks])

    def _mtp_graph(self, reqs, starts, hidden, tokens, topk_in) -> MtpResult:
        """`run_mtp` through `mtp_decode`, one pass per number of positions."""
        by_len: dict[int, list[int]] = {}
        for i, t in enumerate(tokens):
            by_len.setdefault(len(t), []).append(i)
        last: list[torch.Tensor] = [None] * len(reqs)  # type: ignore[list-item]
        logits: list[torch.Tensor] = [None] * len(reqs)  # type: ignore[list-item]
        topk: list[torch.Tensor] = [None] * len(reqs)  # type: ignore[list-item]
        for s, items in by_len.items():
            ids = torch.tensor([tokens[i] for i in items], dtype=torch.int64)
            positions = torch.tensor([starts[i] for i in items], dtype=torch.int64)[:, None] + torch.arange(s)
            given = None if topk_in is None else [topk_in[i] for i in items]
            selected, valid = (None, None) if given is None else pad_topk(given)
            out, draft_logits, used = self.model.mtp_decode(self.cache, ids, torch.cat([hidden[i] for i in items]),
                                                            positions, _tables([reqs[i] for i in items]),
                                                            selected, valid, self._graph_weights())
            used = given or split_topk(used, self.model.config.index_topk, (positions[:, -1] + 1).tolist())
            for j, i in enumerate(items):
                last[i], logits[i], topk[i] = out[j], draft_logits[j], used[j][-1:]
        return MtpResult(torch.stack(last), torch.stack(logits), topk)


def _tables(reqs: list[Request]) -> torch.Tensor:
    """[B, W] block tables, padded with block 0 to the longest (padding lies after every context)."""
    width = max(len(r.block_ids) for r in reqs)
    return torch.tensor([r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs], dtype=torch.int64)
