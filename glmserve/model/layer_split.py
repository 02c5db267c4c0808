"""LayerSplit placement: which contiguous layer range each prefill stage holds.

A pure policy over the `GlmConfig`. Every main layer gets a cost: its weight bytes (exact parameter
counts) and its prefill compute per prompt token (multiply-adds of its projections, MLP or active
experts, and its indexer and sparse attention at a reference prompt length). The first stage also
holds the embedding; the last one the final norm, the LM head and the MTP layer (which, with its own
embedding, is a decoder layer of weights and runs its KV for every prompt position).

`plan_layer_split` first finds the smallest possible load of the most loaded stage (a stage's load
is the weighted mean of its share of the compute and its share of the weight bytes); then, among
splits whose most loaded stage stays within ``tolerance`` of that, it takes the one with the fewest
stages starting on a `shared` indexer layer. A boundary just before a `full` layer has nothing to
carry; one before a `shared` layer makes the previous stage send the top-k of the layer's source
(`GlmConfig.indexer_source`) along with the hidden states. `parse_layer_split` reads an explicit
``0-2,3-7`` instead. Either way the result is a `LayerSplitPlan`, which prints as a table.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmserve.model.config import GlmConfig


@dataclass(frozen=True)
class PlannerConfig:
    compute_weight: float = 0.5  # a stage's load: this share compute, the rest weight bytes
    tolerance: float = 0.10  # how much more load the most loaded stage may take to avoid a carry
    reference_tokens: int = 16384  # prompt length the attention and indexer costs are taken at
    weight_bytes: int = 2  # bytes per parameter (bf16 checkpoints)

    def __post_init__(self) -> None:
        if not 0.0 <= self.compute_weight <= 1.0:
            raise ValueError(f"compute_weight: must be in [0, 1], got {self.compute_weight}")
        if self.tolerance < 0:
            raise ValueError(f"tolerance: must be >= 0, got {self.tolerance}")
        if self.reference_tokens < 1 or self.weight_bytes < 1:
            raise ValueError("reference_tokens: and weight_bytes must be >= 1")


@dataclass(frozen=True)
class LayerCost:
    params: int  # parameters
    compute: float  # multiply-adds per prompt token


def _attention_cost(c: GlmConfig, has_indexer: bool, tokens: int) -> LayerCost:
    h, heads = c.hidden_size, c.num_attention_heads
    params = (h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim
              + h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
              + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * h)
    context = min(c.index_topk, tokens // 2)  # keys each query attends to, on average
    compute = params + context * heads * (c.qk_head_dim + c.v_head_dim)
    if has_indexer:
        ix = c.q_lora_rank * c.index_n_heads * c.index_head_dim + h * c.index_head_dim + 2 * c.index_head_dim
        ix += h * c.index_n_heads
        params += ix
        compute += ix + (tokens // 2) * c.index_n_heads * c.index_head_dim  # scores over the context
    return LayerCost(params, float(compute))


def _mlp_cost(c: GlmConfig, mlp_type: str) -> LayerCost:
    h = c.hidden_size
    if mlp_type == "dense":
        n = 3 * h * c.intermediate_size
        return LayerCost(n, float(n))
    expert = 3 * h * c.moe_intermediate_size
    params = c.n_routed_experts * (h + expert) + expert * c.n_shared_experts
    compute = c.n_routed_experts * h + expert * (c.num_experts_per_tok + c.n_shared_experts)
    return LayerCost(params, float(compute))


def layer_cost(c: GlmConfig, layer: int, tokens: int) -> LayerCost:
    attn = _attention_cost(c, c.indexer_types[layer] == "full", tokens)
    mlp = _mlp_cost(c, c.mlp_layer_types[layer])
    return LayerCost(attn.params + mlp.params + 2 * c.hidden_size, attn.compute + mlp.compute)


def edge_costs(c: GlmConfig, tokens: int) -> tuple[LayerCost, LayerCost]:
    """(first stage's extra: the embedding; last stage's extra: final norm, LM head and MTP layer)."""
    h, v = c.hidden_size, c.vocab_size
    first = LayerCost(v * h, 0.0)
    last_params, last_compute = h + v * h, 0.0  # one row of logits per prompt: negligible compute
    if c.num_nextn_predict_layers:
        attn = _attention_cost(c, True, tokens)
        mlp = _mlp_cost(c, c.mlp_layer_types[-1])
        mtp = attn.params + mlp.params + 2 * h + 2 * h + 2 * h * h + h  # norms, eh_proj, shared_head.norm
        last_params += v * h + mtp  # the MTP layer embeds with its own copy of the embedding
        last_compute = 2 * h * h + h * (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim)  # KV only
    return first, LayerCost(last_params, float(last_compute))


@dataclass(frozen=True)
class StagePlan:
    index: int
    layers: range
    weight_bytes: int
    compute_share: float  # of the whole model's prefill compute
    weight_share: float

    @property
    def is_first(self) -> bool:
        return self.index == 0


@dataclass(frozen=True)
class LayerSplitPlan:
    config: GlmConfig
    stages: tuple[StagePlan, ...]
    source: str  # "planned" or "explicit"

    @property
    def ranges(self) -> tuple[range, ...]:
        return tuple(s.layers for s in self.stages)

    def carries_topk(self, stage: int) -> bool:
        """Whether ``stage`` starts on a shared layer (its predecessor sends the top-k)."""
        return stage > 0 and self.config.indexer_types[self.stages[stage].layers.start] == "shared"

    def spec(self) -> str:
        """The plan as a ``--prefill-layer-split`` value."""
        return ",".join(f"{r.start}-{r.stop - 1}" for r in self.ranges)

    def describe(self) -> str:
        c = self.config
        lines = [f"LayerSplit plan ({self.source}): {len(self.stages)} stage(s) over {c.num_hidden_layers} "
                 f"layers, --prefill-layer-split {self.spec()}"]
        for s in self.stages:
            first = s.layers.start
            if s.index == 0:
                start = "starts at the embedding"
            elif self.carries_topk(s.index):
                start = f"starts on shared layer {first}: carries the top-k of layer {c.indexer_source(first)}"
            else:
                start = f"starts on full layer {first}: nothing to carry"
            extras = [x for x, on in (("embedding", s.index == 0),
                                      ("norm + lm_head + MTP", s.index == len(self.stages) - 1)) if on]
            lines.append(f"  stage {s.index}: layers {first}-{s.layers.stop - 1} ({len(s.layers)})"
                         f"{' + ' + ', '.join(extras) if extras else ''}; {s.weight_bytes / 2**20:,.1f} MiB "
                         f"weights ({s.weight_share:.0%}), {s.compute_share:.0%} of compute; {start}")
        return "\n".join(lines)


class _Costs:
    """Prefix sums of the layer costs, so a stage's load is O(1)."""

    def __init__(self, c: GlmConfig, pc: PlannerConfig) -> None:
        costs = [layer_cost(c, i, pc.reference_tokens) for i in range(c.num_hidden_layers)]
        self.first, self.last = edge_costs(c, pc.reference_tokens)
        self.n, self.pc = c.num_hidden_layers, pc
        self.params, self.compute = [0], [0.0]
        for cost in costs:
            self.params.append(self.params[-1] + cost.params)
            self.compute.append(self.compute[-1] + cost.compute)
        self.total_params = self.params[-1] + self.first.params + self.last.params
        self.total_compute = self.compute[-1] + self.first.compute + self.last.compute

    def stage(self, start: int, stop: int) -> tuple[int, float]:
        params, compute = self.params[stop] - self.params[start], self.compute[stop] - self.compute[start]
        if start == 0:
            params, compute = params + self.first.params, compute + self.first.compute
        if stop == self.n:
            params, compute = params + self.last.params, compute + self.last.compute
        return params, compute

    def load(self, start: int, stop: int) -> float:
        params, compute = self.stage(start, stop)
        w = self.pc.compute_weight
        return w * compute / self.total_compute + (1 - w) * params / self.total_params


def _best_split(costs: _Costs, num_stages: int, cap: float | None, shared_start: list[bool]) -> list[int]:
    """Stage starts minimising (stages starting on a shared layer, max load) lexicographically, each
    stage's load at most ``cap``; with ``cap`` None, only the max load counts."""
    n = costs.n
    inf = (float("inf"), float("inf"))
    # best[s][j]: stages 0..s covering layers 0..j-1; back[s][j]: start of stage s.
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    back = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        load = costs.load(0, j)
        if cap is None or load <= cap:
            best[0][j] = (0.0 if cap is not None else load, load)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                prev = best[s - 1][i]
                load = costs.load(i, j)
                if prev == inf or (cap is not None and load > cap):
                    continue
                worst = max(prev[1], load)
                cand = (prev[0] + shared_start[i], worst) if cap is not None else (worst, worst)
                if cand < best[s][j]:
                    best[s][j], back[s][j] = cand, i
    if best[num_stages - 1][n] == inf:
        raise ValueError("num_stages: no split satisfies the load cap")  # cannot happen with cap >= optimum
    starts, j = [], n
    for s in range(num_stages - 1, 0, -1):
        j = back[s][j]
        starts.append(j)
    return [0, *reversed(starts)]


def _plan(config: GlmConfig, ranges: list[range], costs: _Costs, source: str, pc: PlannerConfig) -> LayerSplitPlan:
    stages = []
    for k, r in enumerate(ranges):
        params, compute = costs.stage(r.start, r.stop)
        stages.append(StagePlan(k, r, params * pc.weight_bytes, compute / costs.total_compute,
                                params / costs.total_params))
    return LayerSplitPlan(config, tuple(stages), source)


def plan_layer_split(config: GlmConfig, num_stages: int, planner: PlannerConfig = PlannerConfig()) -> LayerSplitPlan:
    if not 1 <= num_stages <= config.num_hidden_layers:
        raise ValueError(f"prefill_stages: must be in 1..{config.num_hidden_layers} (one layer per stage "
                         f"at least), got {num_stages}")
    costs = _Costs(config, planner)
    shared = [config.indexer_types[i] == "shared" for i in range(config.num_hidden_layers)] + [False]
    optimum = max(costs.load(a, b) for a, b in _pairs(_best_split(costs, num_stages, None, shared), config))
    starts = _best_split(costs, num_stages, optimum * (1 + planner.tolerance) + 1e-12, shared)
    ranges = [range(a, b) for a, b in _pairs(starts, config)]
    return _plan(config, ranges, costs, "planned", planner)


def _pairs(starts: list[int], config: GlmConfig) -> list[tuple[int, int]]:
    stops = [*starts[1:], config.num_hidden_layers]
    return list(zip(starts, stops, strict=True))


def parse_layer_split(spec: str, config: GlmConfig, num_stages: int | None = None,
                      planner: PlannerConfig = PlannerConfig()) -> LayerSplitPlan:
    """An explicit split such as ``0-2,3-7`` (inclusive ranges, in order, covering every layer once;
    ``5`` alone is ``5-5``). Raises ``ValueError`` naming ``prefill_layer_split``."""
    n = config.num_hidden_layers
    ranges: list[range] = []
    for part in spec.split(","):
        text = part.strip()
        bounds = text.split("-")
        if len(bounds) > 2 or not all(b.strip().isdigit() for b in bounds):
            raise ValueError(f"prefill_layer_split: {text!r} is not a layer range like 3-7")
        first, last = int(bounds[0]), int(bounds[-1])
        if first > last:
            raise ValueError(f"prefill_layer_split: {text!r} ends before it starts")
        expected = ranges[-1].stop if ranges else 0
        if first != expected:
            what = "overlaps the previous range" if first < expected else f"leaves layers {expected}-{first - 1} out"
            raise ValueError(f"prefill_layer_split: {text!r} {what} (each range starts where the last one ended)")
        ranges.append(range(first, last + 1))
    if ranges[-1].stop != n:
        raise ValueError(f"prefill_layer_split: ends at layer {ranges[-1].stop - 1}, the model has layers 0-{n - 1}")
    if num_stages is not None and len(ranges) != num_stages:
        raise ValueError(f"prefill_layer_split: {len(ranges)} ranges for {num_stages} prefill stages")
    return _plan(config, ranges, _Costs(config, planner), "explicit", planner)
