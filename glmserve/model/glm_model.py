"""GlmForCausalLM: GLM-5.x (`GlmMoeDsaForCausalLM`) over glmserve's paged latent cache.

One instance holds a contiguous range of main layers (a LayerSplit stage); the first stage owns the
embedding, the last one the final norm, LM head and MTP layer. Parameter names equal the Hugging Face
checkpoint names (`model.layers.{i}...`, MTP at `model.layers.{num_hidden_layers}`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from glmserve.model.attention import ABSORBED_MAX_QUERIES
from glmserve.model.config import GlmConfig
from glmserve.model.decode_forward import decode_forward, mtp_forward
from glmserve.model.decoder_layer import DecoderLayer
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.forward_context import ForwardContext
from glmserve.model.graph_weights import GraphWeights
from glmserve.model.mtp import MtpLayer
from glmserve.model.norms import RMSNorm, rms_norm
from glmserve.model.paged_cache import PagedKVCache
from glmserve.model.rope import Rope


class GlmBackbone(nn.Module):
    def __init__(self, config: GlmConfig, layers: range, embed: bool, norm: bool, mtp_own_head: bool | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if embed else None
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(config, i, config.indexer_types[i] == "full", config.mlp_layer_types[i])
                for i in layers
            }
        )
        if mtp_own_head is not None:
            n = config.mtp_layer_index
            self.layers[str(n)] = MtpLayer(config, n, own_head=mtp_own_head)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if norm else None


class GlmForCausalLM(nn.Module):
    def __init__(
        self,
        config: GlmConfig,
        layers: range | None = None,
        with_mtp: bool = True,
        mtp_own_head: bool = False,
    ):
        super().__init__()
        layers = range(config.num_hidden_layers) if layers is None else layers
        if not (0 <= layers.start < layers.stop <= config.num_hidden_layers) or layers.step != 1:
            raise ValueError(f"layers: {layers} is not a contiguous range inside 0..{config.num_hidden_layers}")
        self.config = config
        self.layer_range = layers
        self.is_first = layers.start == 0
        self.is_last = layers.stop == config.num_hidden_layers
        self.has_mtp = self.is_last and with_mtp and config.num_nextn_predict_layers > 0
        self.model = GlmBackbone(
            config,
            layers,
            embed=self.is_first or self.has_mtp,
            norm=self.is_last,
            mtp_own_head=mtp_own_head if self.has_mtp else None,
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if self.is_last else None
        self.rope = Rope(config.qk_rope_head_dim, config.rope_theta)
        self._graph_weights: GraphWeights | None = None  # decode_forward's view of the weights, once used
        self.graph_unsupported = GraphWeights.supports(self)  # why `decode` cannot run it (None: it can)
        self.decode_graph_enabled = True  # False: short-query batches too go layer by layer (benchmarks)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def mtp(self) -> MtpLayer:
        if not self.has_mtp:
            raise ValueError("num_nextn_predict_layers: this model (or stage) has no MTP layer")
        return self.model.layers[str(self.config.mtp_layer_index)]

    def context(self, batch: ForwardBatch, cache: PagedKVCache | None = None, **flags) -> ForwardContext:
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        return ForwardContext(batch=batch, cos=cos, sin=sin, cache=cache, **flags)

    def forward(
        self,
        ctx: ForwardContext,
        hidden: torch.Tensor | None = None,
        topk: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Run this stage's layers. The first stage embeds ctx.batch.input_ids; later stages take the
        previous stage's hidden states and, when they start on a shared layer, its carried top-k.
        Returns the hidden states (before the final norm) and the top-k the last layer used."""
        if self.is_first:
            hidden = self.model.embed_tokens(ctx.batch.input_ids)
        elif hidden is None:
            raise ValueError("hidden: a stage that does not start at layer 0 needs the previous stage's output")
        for i in self.layer_range:
            shared = self.config.indexer_types[i] == "shared"
            hidden, topk = self.model.layers[str(i)](hidden, ctx, topk if shared else None)
        return hidden, topk

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def logits(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed_hidden)

    def forward_logits(self, batch: ForwardBatch, cache: PagedKVCache | None = None, **flags) -> torch.Tensor:
        """Whole-model convenience: logits [N, vocab] for every token of the batch (a batch of short
        queries, all of one length, through `decode`)."""
        if not flags and cache is not None and self.decodes(batch):
            b = len(batch.seqs)
            logits, _ = self.decode(cache, batch.input_ids.view(b, -1), batch.positions.view(b, -1), batch.block_tables)
            return logits
        hidden, _ = self.forward(self.context(batch, cache, **flags))
        return self.logits(self.final_norm(hidden))

    # --- decode and verification steps in one function (decode_forward) -------------------------------

    def decodes(self, batch: ForwardBatch) -> bool:
        """Whether `decode` runs this batch: the whole model, every sequence with the same number of new
        tokens, at most ABSORBED_MAX_QUERIES (decode and MTP verification)."""
        lengths = {seq.num_new for seq in batch.seqs}
        return len(lengths) == 1 and self.decodes_queries(lengths.pop())

    def decodes_queries(self, num_new: int) -> bool:
        """Whether `decode` runs sequences of `num_new` new tokens."""
        return self.decode_graph_enabled and 0 < num_new <= ABSORBED_MAX_QUERIES and self.graph_unsupported is None

    def decode(self, cache: PagedKVCache, input_ids: torch.Tensor, positions: torch.Tensor,
               tables: torch.Tensor, weights: GraphWeights | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B * S, V] float32, normed hidden [B * S, hidden]) of B sequences of S new tokens:
        ids and positions [B, S] (each row consecutive), block tables [B, W]; the new tokens' KV is
        stored in `cache`. The same function as `forward`, written for such batches
        (glmserve/model/decode_forward.py). `weights`: `graph_weights()` taken earlier in the same step."""
        w = weights if weights is not None else self.graph_weights()
        cos, sin = self.rope.cos_sin(positions.reshape(-1), self.dtype)
        normed = decode_forward(w, self.config, cache, input_ids, positions, tables, cos, sin)
        return w.head(normed).float(), normed

    def mtp_decode(self, cache: PagedKVCache, input_ids: torch.Tensor, prev_hidden: torch.Tensor,
                   positions: torch.Tensor, tables: torch.Tensor, selected: torch.Tensor | None = None,
                   valid: torch.Tensor | None = None,
                   weights: GraphWeights | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`mtp_step` of B sequences of S positions each in one function (tokens t+1 `input_ids` and
        positions t [B, S], prev_hidden [B * S, hidden], block tables [B, W]), then `mtp_logits` of each
        sequence's last position: (its output [B, hidden], its draft logits [B, V] float32, the positions
        [B, S, K] the queries attended). `selected` / `valid`: an earlier step's selection to reuse
        (decode_forward.mtp_forward). `weights`: as in `decode`."""
        w = weights if weights is not None else self.graph_weights()
        cos, sin = self.rope.cos_sin(positions.reshape(-1), self.dtype)
        out, used = mtp_forward(w.mtp, w.embed, self.config, cache, input_ids, prev_hidden, positions, tables, cos,
                                sin, selected, valid)
        last = out.view(*positions.shape, -1)[:, -1]
        return last, w.mtp.head(rms_norm(last, w.mtp.norm, self.config.rms_norm_eps)).float(), used

    def graph_weights(self) -> GraphWeights:
        """The weights `decode` and `mtp_decode` run, taken again when a parameter changed. The check
        reads every source parameter's version (~130 us for the bundled model, more for larger
        ones), so a caller making several calls in one step takes them once (`ModelRunner`)."""
        if self.graph_unsupported is not None:
            raise ValueError(f"model: decode cannot run {self.graph_unsupported}")
        if self._graph_weights is None or self._graph_weights.stale:
            self._graph_weights = GraphWeights.of(self)
        return self._graph_weights

    def mtp_step(
        self, ctx: ForwardContext, prev_hidden: torch.Tensor, topk_in: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One MTP step. `ctx.batch.input_ids` are the tokens t+1, `ctx.batch.positions` the positions t
        of `prev_hidden` (the main model's normed hidden state, or the previous step's MTP output)."""
        return self.mtp.step(self.model.embed_tokens(ctx.batch.input_ids), prev_hidden, ctx, topk_in)

    def mtp_step_kv(self, ctx: ForwardContext, prev_hidden: torch.Tensor) -> None:
        """Store the MTP layer's KV at `ctx.batch.positions` (inputs as in `mtp_step`), no outputs."""
        self.mtp.step_kv(self.model.embed_tokens(ctx.batch.input_ids), prev_hidden, ctx)

    def mtp_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        head = self.mtp.shared_head
        normed = head.norm(mtp_hidden)
        return head.head(normed) if head.head is not None else self.lm_head(normed)


def with_input_ids(batch: ForwardBatch, input_ids: torch.Tensor) -> ForwardBatch:
    """The same positions and slots with other tokens (MTP runs on the next token at each position)."""
    return dataclasses.replace(batch, input_ids=input_ids)


@torch.no_grad()
def init_random(model: nn.Module, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """Random weights for a fresh model (training, tests): normal matrices, unit norms, zero biases."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or ".k_norm.weight" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=generator)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()
