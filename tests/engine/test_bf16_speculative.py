"""Speculative decoding in bfloat16 gives exactly the tokens of non-speculative decoding in bfloat16."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import prompts, random_model

from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.model.loader import FP32_SUFFIXES


@pytest.fixture(scope="module")
def bf16_model():
    model = random_model().to(torch.bfloat16)
    for name, p in model.named_parameters():  # as the loader keeps them
        if name.endswith(FP32_SUFFIXES):
            p.data = p.data.float()
    return model


def _outputs(model, mtp, ps) -> tuple[list[list[int]], Engine]:
    engine = Engine(model, EngineConfig(block_size=16, kv_cache_bytes=4 * 2**20, max_step_tokens=256, mtp=mtp))
    reqs = engine.generate(ps, SamplingParams(max_tokens=20, temperature=0.0))
    return [r.output_ids for r in reqs], engine


@pytest.mark.slow  # bf16 GEMMs without AVX512-BF16 are slow
@pytest.mark.parametrize("mtp", [1, 3, "auto"])
def test_bf16_speculative_equals_non_speculative(bf16_model, mtp):
    ps = prompts(4, seed=21, max_len=60)
    plain, _ = _outputs(bf16_model, "off", ps)
    spec, engine = _outputs(bf16_model, mtp, ps)
    assert spec == plain
    if mtp != "auto":
        assert engine.stats.draft_tokens > 0
