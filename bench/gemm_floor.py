"""The matmuls of a piece of work, recorded with torch.profiler and replayed alone: its floor.

A step's floor is what its matrix products cost with nothing else around them: the same shapes, dtype
and thread count, on fresh operands, one after another. Everything else a step does (norms, softmax,
gathers, top-k, Python, small-op overhead) is the gap between the step and its floor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from glmserve.model import native_kernels

# The GEMM kernels every matmul, linear and einsum ends in on CPU, and how to rebuild their operands;
# PACKED_LINEAR is PackedLinear's oneDNN product on a prepacked weight (recorded as [in, out]).
PACKED_LINEAR = "mkldnn::_linear_pointwise"
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", PACKED_LINEAR)
DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Gemm:
    op: str
    shapes: tuple[tuple[int, ...], ...]  # operand shapes as recorded (bias first for addmm/baddbmm)
    dtype: str

    @property
    def flops(self) -> int:
        a, b = self.shapes[-2], self.shapes[-1]
        batch = a[0] if len(a) == 3 else 1
        return 2 * batch * a[-2] * a[-1] * b[-1]


def record(fn: Callable[[], Any]) -> tuple[Any, list[Gemm], Any]:
    """Run `fn` under the profiler: (its result, the GEMMs it ran, the profile). The native kernels'
    products come last: the profiler does not see them."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, _native_products() as native:
        result = fn()
    gemms = []
    for event in prof.events():
        if event.name in GEMM_OPS and _no_gemm_parent(event):
            gemms.append(Gemm(event.name, _operand_shapes(event), _dtype(event)))
    return result, gemms + native, prof


def _latent_attention(query, view, index, allowed, latent_dim) -> list[Gemm]:
    """attend_rows' two batched products: scores over the selected rows, then their weighted sum."""
    b, s, h, c = query.shape
    k, dtype = index.shape[-1], DTYPE_NAMES[view.dtype]
    return [Gemm("aten::bmm", ((b * s, h, c), (b * s, c, k)), dtype), Gemm("aten::bmm", ((b * s, h, k), (b * s, k, c)), dtype)]


def _index_scores(q, weights, keys, tables, positions) -> list[Gemm]:
    """Indexer.scores' two float32 products: every head's scores over the context, then their weighted sum."""
    b, s, h, d = q.shape
    t = tables.shape[1] * keys.shape[1]
    return [Gemm("aten::bmm", ((b, s * h, d), (b, d, t)), "float"), Gemm("aten::bmm", ((b * s, 1, h), (b * s, h, t)), "float")]


def _bf16_weight_linear(x, panels, out_features) -> list[Gemm]:
    """PackedLinear's product, as oneDNN's float32 product on the float32 weight computes it."""
    return [Gemm(PACKED_LINEAR, (tuple(x.shape), (x.shape[1], out_features)), "float")]


# The native kernels (glmserve/model/csrc) that compute matrix products, and the GEMMs the torch ops they
# replace run for the same call: the floor counts those products however the step computes them.
NATIVE_PRODUCTS = {"paged_latent_attention": _latent_attention, "paged_index_scores": _index_scores,
                   "bf16_weight_linear": _bf16_weight_linear}


@contextmanager
def _native_products() -> Iterator[list[Gemm]]:
    """The GEMMs of the native kernels' calls while the block runs (the kernels' own results unchanged),
    and each call as a `native::` event of the profile."""
    module, gemms = native_kernels.get(), []
    if module is None:
        yield gemms
        return
    originals = {name: getattr(module, name) for name in NATIVE_PRODUCTS}

    def recorded(name):
        def call(*args):
            gemms.extend(NATIVE_PRODUCTS[name](*args))
            with record_function(f"native::{name}"):  # in the profile's top ops too
                return originals[name](*args)
        return call

    try:
        for name in NATIVE_PRODUCTS:
            setattr(module, name, recorded(name))
        yield gemms
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


def _operand_shapes(event) -> tuple[tuple[int, ...], ...]:
    shapes = tuple(tuple(s) for s in event.input_shapes if s)
    if event.name == PACKED_LINEAR:
        x, (out_features, in_features) = shapes[0], shapes[1]
        return (x, (in_features, out_features))
    return shapes[-3:] if event.name in ("aten::addmm", "aten::baddbmm") else shapes[:2]


def _no_gemm_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in GEMM_OPS:
            return False
        parent = parent.cpu_parent
    return True


def _dtype(event) -> str:
    types = [t for t in getattr(event, "input_types", []) if t]
    return types[0] if types else "float"




def replay_fn(gemms: list[Gemm]) -> Callable[[], None]:
    """A function that runs the same GEMMs on random operands, built once outside the timing and
    shared by GEMMs of the same shapes (a long prefill runs thousands of identical tiles)."""
    calls, made = [], {}
    for g in gemms:
        dtype = DTYPES.get(g.dtype, torch.float32)
        key = (g.op, g.shapes, dtype)
        if key not in made:
            operands = [torch.randn(s, dtype=dtype) for s in g.shapes]
            if g.op == PACKED_LINEAR:
                operands[1] = torch.ops.mkldnn._reorder_linear_weight(operands[1].t().contiguous(), None)
            made[key] = (g.op, operands, torch.empty(*g.shapes[-2][:-1], g.shapes[-1][-1], dtype=dtype))
        calls.append(made[key])

    def run() -> None:
        for op, operands, out in calls:
            if op == PACKED_LINEAR:
                torch.ops.mkldnn._linear_pointwise(*operands, None, "none", [], "")
            elif op in ("aten::mm", "aten::bmm"):
                (torch.mm if op == "aten::mm" else torch.bmm)(*operands, out=out)
            else:
                (torch.addmm if op == "aten::addmm" else torch.baddbmm)(*operands, out=out)

    return run


def total_flops(gemms: list[Gemm]) -> int:
    return sum(g.flops for g in gemms)


def top_ops(prof, n: int = 12) -> str:
    """The profile's top `n` ops by self CPU time, as a markdown table (op, calls, self ms, share)."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    lines = ["| op | calls | self ms | share |", "|---|---|---|---|"]
    for e in rows[:n]:
        lines.append(f"| `{e.key}` | {e.count} | {e.self_cpu_time_total / 1e3:.1f} | {e.self_cpu_time_total / total:.0%} |")
    return "\n".join(lines)


def op_count(prof) -> int:
    """Ops called from Python (top-level aten events), the step's dispatch count."""
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def gemm_summary(gemms: list[Gemm]) -> str:
    kinds = Counter(g.op.split("::")[-1] for g in gemms)
    return ", ".join(f"{n} {k}" for k, n in kinds.most_common())
