"""A random GLM-5 model over the bundled tokenizer's vocabulary (so grammars can run on it), and a
plain reference decoder: one token at a time, no batching, no drafts, each step's logits passed
through a given function of (logits, output so far) before the argmax."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from engine_fixtures import CONFIG

from glmserve.model.config import GlmConfig
from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.glm_model import GlmForCausalLM, init_random
from glmserve.model.kv_layout import KVLayout
from glmserve.model.paged_cache import PagedKVCache
from glmserve.text.tokenizer import Tokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "glm52-tiny"


def bundled_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(BUNDLED)


def vocab_model(tokenizer: Tokenizer, seed: int = 0) -> GlmForCausalLM:
    """The engine fixtures' small model, widened to the tokenizer's vocabulary and its eos ids."""
    config = {**CONFIG, "vocab_size": tokenizer.vocab_size, "eos_token_id": list(tokenizer.eos_token_ids)}
    model = GlmForCausalLM(GlmConfig.from_dict(config))
    init_random(model, std=0.08, generator=torch.Generator().manual_seed(seed))
    return model.eval()


Process = Callable[[torch.Tensor, list[int]], torch.Tensor]


@torch.inference_mode()
def reference_greedy(model: GlmForCausalLM, prompt: Sequence[int], max_new: int, process: Process,
                     block_size: int = 16) -> list[int]:
    """Greedy decoding of one sequence; ``process(logits [V], output so far)`` adjusts each step."""
    stops = set(model.config.eos_token_ids)
    layout = KVLayout.for_config(model.config, block_size, dtype=model.dtype, with_mtp=False)
    n_blocks = (len(prompt) + max_new + block_size - 1) // block_size
    cache, table = PagedKVCache(layout, n_blocks), [list(range(n_blocks))]
    logits = model.forward_logits(ForwardBatch.build([list(prompt)], [0], table, block_size), cache)
    out: list[int] = []
    while True:
        token = int(process(logits[-1].float().clone(), out).argmax())
        out.append(token)
        if token in stops or len(out) >= max_new:
            return out
        logits = model.forward_logits(ForwardBatch.build([[token]], [len(prompt) + len(out) - 1], table, block_size), cache)
