"""load_model: a GLM-5.x checkpoint directory -> GlmForCausalLM (whole model or one LayerSplit stage).

Experts may be stored per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, what Hugging
Face checkpoints and transformers' save_pretrained write) or fused as 3-D tensors
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from glmserve.core.errors import CheckpointError
from glmserve.model import native_kernels
from glmserve.model.checkpoint import Checkpoint
from glmserve.model.config import GlmConfig
from glmserve.model.glm_model import GlmForCausalLM

# Kept in float32 whatever the model dtype, as the reference implementation does.
FP32_SUFFIXES = ("e_score_correction_bias", "indexer.weights_proj.weight")
GLOBAL_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def load_model(
    model_dir: str | Path,
    layers: range | None = None,
    dtype: torch.dtype = torch.float32,
    with_mtp: bool = True,
    device: str | torch.device = "cpu",
) -> GlmForCausalLM:
    config = GlmConfig.from_pretrained(model_dir)
    with Checkpoint(model_dir) as ckpt:
        mtp_head = f"model.layers.{config.mtp_layer_index}.shared_head.head.weight"
        with torch.device("meta"):
            model = GlmForCausalLM(config, layers, with_mtp=with_mtp, mtp_own_head=mtp_head in ckpt)
        model = model.to_empty(device=device)
        used = _fill(model, ckpt, dtype)
        unexpected = sorted(n for n in ckpt.names() if _in_scope(n, model) and n not in used)
        if unexpected:
            raise CheckpointError(f"{model_dir}: unexpected tensors: {', '.join(unexpected)}")
    native_kernels.get()  # built or loaded now, not in the first request's prefill
    return model.eval()


def _fill(model: GlmForCausalLM, ckpt: Checkpoint, dtype: torch.dtype) -> set[str]:
    """Copy every parameter and buffer from the checkpoint; returns the checkpoint names used."""
    used: set[str] = set()
    missing: list[str] = []
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, target in targets.items():
        sources = _sources(name, model.config, ckpt)
        if sources is None:
            missing.append(name)
            continue
        names, tensor = sources
        used.update(names)
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        keep_fp32 = name.endswith(FP32_SUFFIXES)
        with torch.no_grad():
            target.data = tensor.to(device=target.device, dtype=torch.float32 if keep_fp32 else dtype)
    if missing:
        raise CheckpointError(f"missing tensors: {', '.join(missing)}")
    alias = f"model.layers.{model.config.mtp_layer_index}.embed_tokens.weight"
    if model.has_mtp and alias in ckpt:  # DeepSeek-style checkpoints repeat the embedding for MTP
        used.add(alias)
    return used


def _sources(name: str, config: GlmConfig, ckpt: Checkpoint) -> tuple[list[str], torch.Tensor] | None:
    if name in ckpt:
        return [name], ckpt.get(name)
    if name == "lm_head.weight" and config.tie_word_embeddings and "model.embed_tokens.weight" in ckpt:
        return ["model.embed_tokens.weight"], ckpt.get("model.embed_tokens.weight")
    fused = FUSED_EXPERTS.match(name)
    if fused is None:
        return None
    prefix, kind = fused.groups()
    parts = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
    names = [f"{prefix}.{e}.{p}.weight" for e in range(config.n_routed_experts) for p in parts]
    if not all(n in ckpt for n in names):
        return None
    per_expert = [torch.cat([ckpt.get(f"{prefix}.{e}.{p}.weight") for p in parts]) for e in range(config.n_routed_experts)]
    return names, torch.stack(per_expert)


def _in_scope(name: str, model: GlmForCausalLM) -> bool:
    """Whether a checkpoint tensor belongs to what this stage loads (other stages' layers do not)."""
    if name in GLOBAL_NAMES:
        return {
            "model.embed_tokens.weight": model.model.embed_tokens is not None,
            "model.norm.weight": model.is_last,
            "lm_head.weight": model.is_last,
        }[name]
    layer = LAYER_NAME.match(name)
    if layer is None:
        return True  # not a name any GLM checkpoint has: report it
    idx = int(layer.group(1))
    if idx >= model.config.num_hidden_layers:
        return model.has_mtp
    return idx in model.layer_range
