"""save_model: write a GlmForCausalLM as a Hugging Face checkpoint (what transformers would read).

Experts are written per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`), the layout of
published GLM checkpoints; `fused_experts=True` keeps the 3-D tensors instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from glmserve.model.checkpoint import INDEX_FILE, SINGLE_FILE
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.loader import FP32_SUFFIXES


def checkpoint_tensors(
    model: GlmForCausalLM, fused_experts: bool = False, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Checkpoint names -> tensors; `dtype` casts all but the tensors the reference keeps in fp32."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().contiguous()
        if dtype is not None and not name.endswith(FP32_SUFFIXES):
            tensor = tensor.to(dtype)
        if fused_experts or not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name] = tensor
            continue
        prefix, kind = name.rsplit(".", 1)
        for e, w in enumerate(tensor):
            if kind == "gate_up_proj":
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = w.contiguous()
    return out


def save_model(
    model: GlmForCausalLM,
    model_dir: str | Path,
    fused_experts: bool = False,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Weights only (config.json is the caller's); sharded with an index when max_shard_bytes is given."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, fused_experts, dtype)
    if max_shard_bytes is None:
        save_file(tensors, model_dir / SINGLE_FILE, metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, model_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
