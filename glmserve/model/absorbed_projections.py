"""AbsorbedProjections: the query and output projections of absorbed MLA, with kv_b_proj folded in.

The absorbed kernel attends in latent space: its query is q_nope through kv_b_proj's key half (w_uk),
joined with the rotated rope part and scaled, and its latent output goes through kv_b_proj's value
half (w_uv) and then o_proj. Run as written that is two matmuls, two per-head batched matmuls and the
copies of w_uk and w_uv that einsum makes on every call. All of it is linear in q_resid (the rope
rotation is a per-position linear map of the rope part, and commutes with the scale), so

    query  = rope(q_resid @ W_q^T)           W_q[h] = scale * [w_uk[h]^T @ Wq_nope[h]; Wq_rope[h]]
    output = latent_out @ W_o^T              W_o[:, h] = o_proj[:, h] @ w_uv[h]

is one matmul on each side. Folding pays where a step is per-op overhead (small models on CPU:
decode steps of the bundled model); the folded weights are larger than the parts (H x (latent + rope)
rows instead of H x qk_head_dim, H x latent columns instead of H x v_head_dim), so a model whose
folded weights exceed FOLD_MAX_PARAMS keeps the unfolded form, as decode there reads its weights'
bytes. Like FusedLinear, the folded weights are a cache of the layers', rebuilt whenever a part's
storage or version changes; the layers themselves stay as the checkpoint names them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmserve.model.fused_linear import version_key
from glmserve.model.rope import apply_rope

# Parameters of both folded matrices of one layer up to which the absorbed kernel uses them
# (the bundled model: 0.25M; GLM-5 sizes: ~280M, where folding would double decode's weight reads).
FOLD_MAX_PARAMS = 1 << 22


class AbsorbedProjections:
    def __init__(self, q_b_proj: nn.Linear, kv_b_proj: nn.Linear, o_proj: nn.Linear, heads: int,
                 nope_dim: int, rope_dim: int, v_dim: int, latent_dim: int, scaling: float):
        # Plain references, not submodules: the layers stay registered under their own names.
        self.layers = (q_b_proj, kv_b_proj, o_proj)
        self.heads, self.nope_dim, self.rope_dim, self.v_dim, self.latent_dim = heads, nope_dim, rope_dim, v_dim, latent_dim
        self.scaling = scaling
        q_lora, hidden = q_b_proj.in_features, o_proj.out_features
        self.folds = heads * ((latent_dim + rope_dim) * q_lora + hidden * latent_dim) <= FOLD_MAX_PARAMS
        self._key: tuple | None = None
        self._weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def query(self, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The absorbed kernel's query [N, H, latent + rope], scaled, from q_resid [N, q_lora_rank]."""
        q_b_proj = self.layers[0]
        if self.folds and not torch.is_grad_enabled():
            w_q, _ = self._folded()
            q = F.linear(q_resid, w_q).view(q_resid.shape[0], self.heads, -1)
            return torch.cat([q[..., : self.latent_dim], apply_rope(q[..., self.latent_dim :], cos, sin)], dim=-1)
        q = q_b_proj(q_resid).view(q_resid.shape[0], self.heads, -1)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_lat = torch.einsum("nhd,hdc->nhc", q_nope, self._w_kv()[:, : self.nope_dim])
        return torch.cat([q_lat, apply_rope(q_rot, cos, sin)], dim=-1).mul_(self.scaling)

    def output(self, latent_out: torch.Tensor) -> torch.Tensor:
        """The layer's attention output [N, hidden] from the kernel's latent output [N, H, latent] (any dtype)."""
        o_proj = self.layers[2]
        latent_out = latent_out.to(o_proj.weight.dtype)
        if self.folds and not torch.is_grad_enabled():
            _, w_o = self._folded()
            return F.linear(latent_out.reshape(latent_out.shape[0], -1), w_o)
        out = torch.einsum("nhc,hvc->nhv", latent_out, self._w_kv()[:, self.nope_dim :])
        return o_proj(out.reshape(latent_out.shape[0], -1))

    def _w_kv(self) -> torch.Tensor:
        return self.layers[1].weight.view(self.heads, self.nope_dim + self.v_dim, self.latent_dim)

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = version_key([layer.weight for layer in self.layers])
        if key != self._key:
            with torch.inference_mode(False), torch.no_grad():
                self._weights = self._fold()
            self._key = key
        return self._weights

    def _fold(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_q [H * (latent + rope), q_lora_rank], W_o [hidden, H * latent]), folded in float32."""
        q_b_proj, _, o_proj = self.layers
        dtype = q_b_proj.weight.dtype
        h = self.heads
        w_q = q_b_proj.weight.float().view(h, self.nope_dim + self.rope_dim, -1)
        w_kv = self._w_kv().float()
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim :]
        q_lat = torch.bmm(w_uk.transpose(1, 2), w_q[:, : self.nope_dim])  # [H, latent, q_lora]
        w_query = torch.cat([q_lat, w_q[:, self.nope_dim :]], dim=1).mul_(self.scaling).reshape(-1, w_q.shape[-1])
        w_o = o_proj.weight.float().view(-1, h, self.v_dim)  # [hidden, H, v]
        w_out = torch.einsum("ohv,hvc->ohc", w_o, w_uv).reshape(w_o.shape[0], -1)
        return w_query.to(dtype).contiguous(), w_out.to(dtype).contiguous()
