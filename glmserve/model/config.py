"""GlmConfig: the GLM-5.x (`glm_moe_dsa`) architecture as glmserve serves it.

Read from a Hugging Face `config.json`; every derived field follows transformers' `GlmMoeDsaConfig`
exactly, so the same checkpoint means the same model in both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ROPE_TYPES = ("default",)
INDEXER_TYPES = ("full", "shared")
MLP_TYPES = ("dense", "sparse")


def derive_indexer_types(num_layers: int, raw: dict[str, Any]) -> list[str]:
    """Per-layer indexer schedule, with the rule transformers uses when `indexer_types` is absent."""
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            letters = {"F": "full", "S": "shared"}
            bad = [c for c in pattern if c not in letters]
            if bad:
                raise ValueError(f"index_topk_pattern: unknown letters {bad!r} (want F or S)")
            return [letters[c] for c in pattern]
        return list(pattern)
    freq = max(int(raw.get("index_topk_freq", 1)), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(raw.get("rope_theta", 10000.0))
    return rope


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class GlmConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    indexer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    num_nextn_predict_layers: int
    index_share_for_mtp_iteration: bool
    rope_theta: float
    rope_parameters: dict[str, Any] = field(hash=False, compare=False)
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def mtp_layer_index(self) -> int:
        """Checkpoint index of the (first) MTP layer: right after the main layers."""
        return self.num_hidden_layers

    def indexer_source(self, layer: int) -> int:
        """The full layer whose top-k `layer` uses (itself when it is full)."""
        for i in range(layer, -1, -1):
            if self.indexer_types[i] == "full":
                return i
        raise ValueError(f"indexer_types: layer {layer} is shared but no earlier layer is full")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GlmConfig:
        n_layers = int(raw["num_hidden_layers"])
        indexer_types = list(raw.get("indexer_types") or derive_indexer_types(n_layers, raw))
        n_dense = min(int(raw.get("first_k_dense_replace", 3)), n_layers)
        mlp_types = list(raw.get("mlp_layer_types") or ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense))
        rope = _rope_parameters(raw)
        config = cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            n_routed_experts=int(raw.get("n_routed_experts", raw.get("num_experts", 0))),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
            n_shared_experts=int(raw.get("n_shared_experts", 1)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            n_group=int(raw.get("n_group", 1)),
            topk_group=int(raw.get("topk_group", 1)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            index_topk=int(raw.get("index_topk", 2048)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_n_heads=int(raw.get("index_n_heads", 32)),
            indexer_types=tuple(indexer_types),
            mlp_layer_types=tuple(mlp_types),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0)),
            index_share_for_mtp_iteration=bool(raw.get("index_share_for_mtp_iteration", False)),
            rope_theta=float(rope["rope_theta"]),
            rope_parameters=rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 202752)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            hidden_act=str(raw.get("hidden_act", "silu")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
        )
        config.validate()
        return config

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> GlmConfig:
        path = Path(model_dir) / "config.json"
        raw = json.loads(path.read_text())
        model_type = raw.get("model_type")
        if model_type != "glm_moe_dsa":
            raise ValueError(f"model_type: {model_type!r} in {path} is not 'glm_moe_dsa'")
        return cls.from_dict(raw)

    def validate(self) -> None:
        n = self.num_hidden_layers
        if n < 1:
            raise ValueError(f"num_hidden_layers: must be >= 1, got {n}")
        if self.q_lora_rank is None or int(self.q_lora_rank) < 1:
            raise ValueError("q_lora_rank: the DSA indexer reads the q_lora residual, so it must be set")
        if len(self.indexer_types) != n:
            raise ValueError(f"indexer_types: {len(self.indexer_types)} entries for {n} layers")
        unknown = sorted({t for t in self.indexer_types if t not in INDEXER_TYPES})
        if unknown:
            raise ValueError(f"indexer_types: unknown values {unknown} (want 'full' or 'shared')")
        if self.indexer_types[0] != "full":
            raise ValueError("indexer_types: layer 0 must be 'full' (a shared layer needs an earlier full one)")
        if len(self.mlp_layer_types) != n:
            raise ValueError(f"mlp_layer_types: {len(self.mlp_layer_types)} entries for {n} layers")
        unknown = sorted({t for t in self.mlp_layer_types if t not in MLP_TYPES})
        if unknown:
            raise ValueError(f"mlp_layer_types: unknown values {unknown} (want 'dense' or 'sparse')")
        rope_type = self.rope_parameters.get("rope_type")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_parameters.rope_type: {rope_type!r} is not supported (have {SUPPORTED_ROPE_TYPES})")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError("qk_rope_head_dim: must be even and no larger than index_head_dim")
        if "sparse" in self.mlp_layer_types:
            if self.n_routed_experts < 1 or not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError("num_experts_per_tok: must be between 1 and n_routed_experts")
            if self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError("n_group: must divide n_routed_experts, and topk_group must be in 1..n_group")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: {self.hidden_act!r} is not supported (only 'silu')")
        if self.num_nextn_predict_layers < 0:
            raise ValueError("num_nextn_predict_layers: must be >= 0")
