"""MTP (NextN) layer, as DeepSeek-V3 defines multi-token prediction.

Given the main model's final (normed) hidden state h_t at position t and the embedding of token t+1,
    h' = DecoderLayer(eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)]))   at position t
and shared_head.norm(h') through the LM head gives logits for token t+2. Iterating feeds h' and the
drafted token back in at position t+1, and so on. The layer has its own KV cache entry and indexer.
"""

from __future__ import annotations

import torch
from torch import nn

from glmserve.model.config import GlmConfig
from glmserve.model.decoder_layer import DecoderLayer
from glmserve.model.forward_context import ForwardContext
from glmserve.model.norms import RMSNorm


class SharedHead(nn.Module):
    def __init__(self, config: GlmConfig, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None


class MtpLayer(DecoderLayer):
    def __init__(self, config: GlmConfig, layer_idx: int, own_head: bool = False):
        super().__init__(config, layer_idx, has_indexer=True, mlp_type=config.mlp_layer_types[-1])
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config, own_head)

    def step(
        self,
        token_embeds: torch.Tensor,
        prev_hidden: torch.Tensor,
        ctx: ForwardContext,
        topk_in: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One draft step: the layer's output hidden state [N, hidden] and the top-k it used."""
        return self.forward(self._fuse(token_embeds, prev_hidden), ctx, topk_in)

    def step_kv(self, token_embeds: torch.Tensor, prev_hidden: torch.Tensor, ctx: ForwardContext) -> None:
        """The layer's KV at these positions, without outputs: positions whose draft nobody needs
        (all but the last of a prompt chunk or of caught-up decode steps) only have to be attendable."""
        self.write_kv(self._fuse(token_embeds, prev_hidden), ctx)

    def _fuse(self, token_embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(prev_hidden)], dim=-1))
