"""Speculative decoding in bfloat16 gives exactly the tokens of non-speculative decoding in bfloat16."""

from __future__ import annotations

import random

import pytest
import torch
from engine_fixtures import prompts, random_model

from glmserve.core.generation import SamplingParams
from glmserve.engine.engine import Engine, EngineConfig
from glmserve.model.dtype_choice import auto_dtype
from glmserve.model.loader import FP32_SUFFIXES, load_model
from glmserve.text.tokenizer import Tokenizer
from tests.model.conftest import BUNDLED_DIR
from tools import tiny_corpus


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


@pytest.mark.slow
@pytest.mark.cpu_feature(auto_dtype() == torch.bfloat16, feature="bfloat16 instructions (auto is float32 here)")
def test_bundled_model_at_batch_32_speculates_losslessly():
    # 32 code prompts at once: verification steps of 64 rows against decode steps of 32, where oneDNN
    # summed rows of 33+ row products in another order (fixed by PackedLinear.MAX_ROWS); 1 request in
    # 32 diverged before. The same outputs off, with one draft and with the adaptive policy.
    if not (BUNDLED_DIR / "model.safetensors").exists():
        pytest.skip("bundled model missing")
    model = load_model(BUNDLED_DIR, dtype=torch.bfloat16)
    tokenizer = Tokenizer.from_dir(BUNDLED_DIR)
    ids = [tokenizer.encode(text) for text in tiny_corpus.stdlib_texts("heldout")]
    rng = random.Random(0)
    ps = []
    for i in range(32):
        doc = [d for d in ids if len(d) >= 512][i % 8]
        start = rng.randrange(len(doc) - 256)
        ps.append(doc[start : start + rng.randint(128, 256)])
    params = SamplingParams(max_tokens=64, temperature=0.0)
    outputs = {}
    for mtp in ("off", 1):
        engine = Engine(model, EngineConfig(mtp=mtp, prefix_caching=False))
        outputs[mtp] = [r.output_ids for r in engine.generate(ps, params)]
    assert outputs[1] == outputs["off"]
