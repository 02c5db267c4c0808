"""The bfloat16 path: teacher-forced logits of the bundled model within BF16_TOL of transformers in
bfloat16, and the same greedy token wherever transformers' top-2 margin exceeds BF16_TOL and the logits
stay within it (almost everywhere else that the margin is clear, too).

bf16 keeps 8 bits of mantissa: a logit near 10 is only resolved to ~0.06, and both implementations
round at different places (glmserve's absorbed decode, fused projections, fp32 islands), so a
near-tie in an expert choice or a top-k cut can go either way and move a few positions further.
transformers in bf16 itself differs from its float32 by up to ~1.5 on these prompts. Hence a bound
on most positions, not all, and greedy agreement only where the decision is clear: a position past the
bound (one of 254 clear positions on the third prompt here) may flip.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glmserve.model.dtype_choice import auto_dtype, resolve_dtype
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.kv_layout import KVLayout
from glmserve.model.loader import load_model
from glmserve.model.paged_cache import PagedKVCache
from glmserve.text.tokenizer import Tokenizer
from tools import tiny_corpus

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "glm52-tiny"
BF16_TOL = 0.25  # logits
WITHIN_TOL_SHARE = 0.95  # of positions whose largest logit difference is at most BF16_TOL
CLEAR_AGREEMENT = 0.98  # greedy agreement over all clear positions, past the bound included
BLOCK, CHUNK, LENGTH = 16, 100, 320  # chunks through the paged cache; longer than index_topk (128)

pytestmark = [pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(), reason="bundled model missing"),
              pytest.mark.slow]


def _prompts(n: int) -> list[list[int]]:
    tokenizer = Tokenizer.from_dir(MODEL_DIR)
    windows = [tokenizer.encode(text) for text in tiny_corpus.stdlib_texts("heldout")[: 2 * n]]
    return [ids[:LENGTH] for ids in windows if len(ids) >= LENGTH][:n]


def _chunked_logits(model, ids: list[int]) -> torch.Tensor:
    layout = KVLayout.for_config(model.config, BLOCK, torch.bfloat16, with_mtp=False)
    cache = PagedKVCache(layout, num_blocks=LENGTH // BLOCK + 2)
    table = list(range(cache.num_blocks - 1, -1, -1))
    out = [model.forward_logits(ForwardBatch.build([ids[s : s + CHUNK]], [s], [table], BLOCK), cache)
           for s in range(0, len(ids), CHUNK)]
    return torch.cat(out).float()


@torch.no_grad()
def test_bf16_logits_and_greedy_tokens_follow_transformers_bf16():
    from transformers import GlmMoeDsaForCausalLM

    ref = GlmMoeDsaForCausalLM.from_pretrained(MODEL_DIR, attn_implementation="eager", dtype=torch.bfloat16).eval()
    ours = load_model(MODEL_DIR, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    for ids in _prompts(3):
        expected = ref(torch.tensor([ids])).logits[0].float()
        got = _chunked_logits(ours, ids)
        worst = (got - expected).abs().max(-1).values
        assert (worst <= BF16_TOL).float().mean().item() >= WITHIN_TOL_SHARE
        top2 = expected.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > BF16_TOL
        assert clear.sum() > LENGTH // 2
        same = got.argmax(-1) == expected.argmax(-1)
        assert same[clear & (worst <= BF16_TOL)].all()
        assert same[clear].float().mean().item() >= CLEAR_AGREEMENT


def test_auto_dtype_is_bf16_only_with_bf16_instructions():
    assert auto_dtype(frozenset({"avx2", "fma"})) == torch.float32
    assert auto_dtype(frozenset({"avx512f", "avx512bw", "avx512_vnni"})) == torch.float32
    assert auto_dtype(frozenset({"avx512f", "avx512_bf16"})) == torch.bfloat16
    assert auto_dtype(frozenset({"avx512_bf16", "amx_bf16", "amx_tile"})) == torch.bfloat16
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float16")


def test_the_environment_pins_what_auto_means(monkeypatch):
    monkeypatch.setenv("GLMSERVE_DTYPE", "bfloat16")
    assert resolve_dtype("auto") == torch.bfloat16 and resolve_dtype("float32") == torch.float32
    monkeypatch.setenv("GLMSERVE_DTYPE", "float16")
    with pytest.raises(ValueError, match="GLMSERVE_DTYPE"):
        resolve_dtype("auto")
