"""GraphWeights: the tensors `decode_forward` reads, taken from a whole GlmForCausalLM once.

Plain tensors, so the decode pass makes no module calls and checks no per-layer caches: the model's
own parameters, or for the fused and folded projections the same caches the layers build
(FusedLinear's concatenation, AbsorbedProjections' folded query and output), so both paths compute
with exactly those weights; matmul weights as PackedLinear (the same bits, laid out once for oneDNN). `GlmForCausalLM.decode` and `mtp_decode` take them again when `stale` (a layer's
parameter changed in place or its storage changed; a layer module replaced after the first
decode is not seen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmserve.model.attention import MLAttention
from glmserve.model.fused_linear import version_key
from glmserve.model.indexer import Indexer
from glmserve.model.mlp import GatedMLP
from glmserve.model.moe import DENSE_MAX_RATIO, MoE, TopkRouter
from glmserve.model.packed_linear import PackedLinear

if TYPE_CHECKING:
    from glmserve.model.glm_model import GlmForCausalLM

@dataclass(frozen=True)
class MlpWeights:
    gate_up: PackedLinear  # [2 * intermediate, hidden]: gate rows, then up rows
    down: PackedLinear  # [hidden, intermediate]


@dataclass(frozen=True)
class MoeWeights:
    """Every routed expert and the shared expert as one gated MLP of E * I + I_shared columns."""
    router: TopkRouter  # the layer's own router (routing is a few small ops, no weights to rearrange)
    gate_up: PackedLinear  # [2 * (E * I + I_shared), hidden]: the experts' gate rows and the shared one's, then the up rows
    down: PackedLinear  # [hidden, E * I + I_shared]: every expert's down projection side by side, the shared one's last
    routed_width: int  # E * I: the columns the router weighs (the shared expert's weigh 1)


@dataclass(frozen=True)
class LayerWeights:
    index: int  # the layer's number: where its KV lives in a cache layout
    input_norm: torch.Tensor
    input_proj: PackedLinear  # q_a_proj and kv_a_proj_with_mqa (and the indexer's wk), one matmul
    q_norm: torch.Tensor
    kv_norm: torch.Tensor
    query: PackedLinear  # folded W_q [H * (latent + rope), q_lora_rank], scale included
    output: PackedLinear  # folded W_o [hidden, H * latent]
    post_norm: torch.Tensor
    mlp: MlpWeights | MoeWeights
    indexer: Indexer | None  # full layers' own (its wk is in input_proj); shared layers reuse the selection


@dataclass(frozen=True)
class MtpWeights:
    """The MTP layer as `mtp_forward` reads it: the input norms and their fusion, the decoder layer, its
    head (norm and projection)."""
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: PackedLinear
    layer: LayerWeights
    norm: torch.Tensor  # the shared head's norm
    head: PackedLinear  # the shared head's own projection, or the LM head


@dataclass(frozen=True)
class GraphWeights:
    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    head: PackedLinear  # the LM head
    mtp: MtpWeights | None  # None: the model has no MTP layer
    sources: tuple[torch.Tensor, ...]  # the parameters these were taken from
    key: tuple  # their version_key when taken

    @property
    def stale(self) -> bool:
        """Whether a source parameter changed since (in place, or its storage)."""
        return version_key(list(self.sources)) != self.key

    @staticmethod
    def supports(model: GlmForCausalLM) -> str | None:
        """Why the graph cannot run this model (None: it can)."""
        c = model.config
        if not (model.is_first and model.is_last):
            return "a LayerSplit stage (the graph needs the whole model)"
        if c.n_group > 1:
            return "grouped expert routing (n_group > 1)"
        if c.n_routed_experts > DENSE_MAX_RATIO * max(c.num_experts_per_tok, 1):
            return f"{c.n_routed_experts} experts, top-{c.num_experts_per_tok} (dense experts would cost more than grouping)"
        if not all(layer.self_attn.absorbed.folds for _, layer in _numbered_layers(model)):
            return "attention projections too large to fold"
        return None

    @classmethod
    def of(cls, model: GlmForCausalLM, prepack: bool = True) -> GraphWeights:
        """`prepack`: matmul weights in oneDNN's layout where that computes the same bits (PackedLinear)."""
        # Plain tensors without autograd history, wherever this is called from (as FusedLinear's cache).
        with torch.inference_mode(False), torch.no_grad():
            numbered = _numbered_layers(model)
            layers = tuple(_layer(i, layer, prepack) for i, layer in numbered)
            head = PackedLinear.of(model.lm_head.weight, prepack)
            mtp = _mtp(model, head, prepack) if model.has_mtp else None
            numbered += [(model.config.mtp_layer_index, model.mtp)] if model.has_mtp else []
            sources = tuple(p for _, layer in numbered for p in layer.parameters())
            sources += (model.model.embed_tokens.weight, model.model.norm.weight, model.lm_head.weight)
            return cls(model.model.embed_tokens.weight, layers, model.model.norm.weight, head, mtp, sources,
                       version_key(list(sources)))


def _numbered_layers(model: GlmForCausalLM):
    return [(i, model.model.layers[str(i)]) for i in model.layer_range]


def _mtp(model: GlmForCausalLM, lm_head: PackedLinear, prepack: bool) -> MtpWeights:
    m = model.mtp
    own = m.shared_head.head
    return MtpWeights(m.enorm.weight, m.hnorm.weight, PackedLinear.of(m.eh_proj.weight, prepack),
                      _layer(model.config.mtp_layer_index, m, prepack), m.shared_head.norm.weight,
                      lm_head if own is None else PackedLinear.of(own.weight, prepack))


def _layer(index: int, layer, prepack: bool) -> LayerWeights:
    a: MLAttention = layer.self_attn
    query, output = a.absorbed._folded()
    parts = [a.q_a_proj.weight, a.kv_a_proj_with_mqa.weight]
    if a.indexer is not None:
        parts.append(a.indexer.wk.weight)
    return LayerWeights(index, layer.input_layernorm.weight, PackedLinear.of(torch.cat(parts), prepack),
                        a.q_a_layernorm.weight, a.kv_a_layernorm.weight, PackedLinear.of(query, prepack),
                        PackedLinear.of(output, prepack), layer.post_attention_layernorm.weight,
                        _mlp(layer.mlp, prepack), a.indexer)


def _mlp(mlp, prepack: bool) -> MlpWeights | MoeWeights:
    if isinstance(mlp, GatedMLP):
        return _dense(mlp, prepack)
    assert isinstance(mlp, MoE)
    gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj  # [E, 2I, H], [E, H, I]
    e, i = gate_up.shape[0], gate_up.shape[1] // 2
    shared = mlp.shared_experts
    gates = torch.cat([gate_up[:, :i].flatten(0, 1), shared.gate_proj.weight])
    ups = torch.cat([gate_up[:, i:].flatten(0, 1), shared.up_proj.weight])
    downs = torch.cat([down.permute(1, 0, 2).flatten(1), shared.down_proj.weight], dim=1)
    return MoeWeights(mlp.gate, PackedLinear.of(torch.cat([gates, ups]), prepack),
                      PackedLinear.of(downs.contiguous(), prepack), e * i)


def _dense(mlp: GatedMLP, prepack: bool) -> MlpWeights:
    return MlpWeights(PackedLinear.of(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), prepack),
                      PackedLinear.of(mlp.down_proj.weight, prepack))
