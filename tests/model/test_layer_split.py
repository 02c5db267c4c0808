"""LayerSplit placement: balanced contiguous stages, boundaries before full layers, explicit splits."""

from __future__ import annotations

import pytest
import torch
from reference import config_dict
from test_config import GLM52

from glmserve.model.config import GlmConfig
from glmserve.model.glm_model import GlmForCausalLM
from glmserve.model.layer_split import PlannerConfig, parse_layer_split, plan_layer_split

TINY = GlmConfig.from_dict(config_dict("glm52_schedule", num_hidden_layers=8))


def _covers(plan, n):
    assert plan.ranges[0].start == 0 and plan.ranges[-1].stop == n
    assert all(a.stop == b.start and len(a) > 0 for a, b in zip(plan.ranges, plan.ranges[1:], strict=False))


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
def test_stages_are_contiguous_and_cover_every_layer(stages):
    plan = plan_layer_split(TINY, stages)
    assert len(plan.stages) == stages
    _covers(plan, 8)
    assert abs(sum(s.weight_share for s in plan.stages) - 1) < 1e-9
    assert abs(sum(s.compute_share for s in plan.stages) - 1) < 1e-9


def test_weight_bytes_are_the_stage_models_parameters():
    """The planner's parameter counts are exact: they equal the stage model's (built on meta)."""
    for config in (TINY, GlmConfig.from_dict(GLM52)):
        plan = plan_layer_split(config, 4, PlannerConfig(weight_bytes=1))
        for stage in plan.stages:
            with torch.device("meta"):
                model = GlmForCausalLM(config, stage.layers)
            assert stage.weight_bytes == sum(p.numel() for p in model.parameters()), stage


def test_glm52_boundaries_fall_before_full_layers_and_balance():
    config = GlmConfig.from_dict(GLM52)
    for stages in (2, 4):  # 8 stages of ~10 layers cannot all start on a full layer (every 4th)
        plan = plan_layer_split(config, stages)
        _covers(plan, 78)
        assert not any(plan.carries_topk(k) for k in range(stages)), plan.describe()
        shares = [s.weight_share for s in plan.stages]
        assert max(shares) < 1.25 / stages, plan.describe()


def test_tolerance_trades_balance_for_no_carry():
    """Bundled schedule (full 0,1,2,6): the balanced 2-way split starts stage 1 on shared layer 4;
    enough tolerance moves the boundary before a full layer; none keeps the optimum."""
    strict = plan_layer_split(TINY, 2, PlannerConfig(tolerance=0.0))
    assert strict.carries_topk(1)
    assert "carries the top-k of layer 2" in strict.describe()
    loose = plan_layer_split(TINY, 2, PlannerConfig(tolerance=1.0))
    assert not loose.carries_topk(1)
    assert TINY.indexer_types[loose.ranges[1].start] == "full"


def test_explicit_split_and_its_errors():
    plan = parse_layer_split("0-2, 3-7", TINY, num_stages=2)
    assert plan.ranges == (range(0, 3), range(3, 8)) and plan.carries_topk(1) and plan.source == "explicit"
    assert plan.spec() == "0-2,3-7"
    assert parse_layer_split("0-6,7", TINY).ranges == (range(0, 7), range(7, 8))
    for spec, message in [
        ("0-2,4-7", "leaves layers 3-3 out"),
        ("0-3,3-7", "overlaps"),
        ("0-2,3-6", "ends at layer 6"),
        ("1-7", "leaves layers 0-0 out"),
        ("0-2,5-3", "ends before it starts"),
        ("0-2,x", "not a layer range"),
        ("0-2,", "not a layer range"),
    ]:
        with pytest.raises(ValueError, match=f"prefill_layer_split: .*{message}"):
            parse_layer_split(spec, TINY)
    with pytest.raises(ValueError, match="prefill_layer_split: 2 ranges for 4 prefill stages"):
        parse_layer_split("0-2,3-7", TINY, num_stages=4)
    with pytest.raises(ValueError, match="prefill_stages"):
        plan_layer_split(TINY, 9)


def test_planner_config_is_validated():
    with pytest.raises(ValueError, match="compute_weight"):
        PlannerConfig(compute_weight=2)
    with pytest.raises(ValueError, match="tolerance"):
        PlannerConfig(tolerance=-1)
