"""glmserve's GLM-5 model equals transformers' GlmMoeDsaForCausalLM (eager, float32)."""

from __future__ import annotations

import pytest
import torch
from reference import VARIANTS, make_reference

from glmserve.model.forward_batch import ForwardBatch
from glmserve.model.kv_layout import KVLayout
from glmserve.model.loader import load_model
from glmserve.model.paged_cache import PagedKVCache

TOL = 1e-4


def _prompt(length: int, seed: int, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=g).tolist()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(transformers model, glmserve model loaded from its save_pretrained checkpoint)."""
    path = tmp_path_factory.mktemp(request.param)
    ref = make_reference(path, request.param, initializer_range=0.06)
    return request.param, ref, load_model(path, with_mtp=False)


@torch.no_grad()
def test_prefill_logits_match(pair):
    variant, ref, ours = pair
    ids = _prompt(333, seed=1)
    expected = ref(torch.tensor([ids])).logits[0]
    got = ours.forward_logits(ForwardBatch.build([ids], [0], [[0]], block_size=512))
    assert (got - expected).abs().max().item() <= TOL
    if variant == "very_sparse":  # the top-k really restricts attention here
        dense = ours.forward_logits(ForwardBatch.build([ids], [0], [[0]], block_size=512), dense_attention=True)
        assert (dense - expected).abs().max().item() > 100 * TOL


def _paged_prefill(ours, cache, prompts, tables, block_size, split_at=None):
    """Prefill all prompts in one batch; the last prompt optionally in two chunks (cached prefix)."""
    if split_at is None:
        batch = ForwardBatch.build(prompts, [0] * len(prompts), tables, block_size)
        return ours.forward_logits(batch, cache)
    head = ForwardBatch.build([prompts[-1][:split_at]], [0], tables[-1:], block_size)
    ours.forward_logits(head, cache)
    firsts = prompts[:-1] + [prompts[-1][split_at:]]
    batch = ForwardBatch.build(firsts, [0] * (len(prompts) - 1) + [split_at], tables, block_size)
    return ours.forward_logits(batch, cache)


@torch.no_grad()
def test_paged_batched_decode_matches_cached_decoding(pair):
    variant, ref, ours = pair
    block_size, steps = 16, 20
    prompts = [_prompt(n, seed=n) for n in (70, 101, 150)]
    layout = KVLayout.for_config(ours.config, block_size=block_size, dtype=torch.float32, with_mtp=False)
    cache = PagedKVCache(layout, num_blocks=64)
    # Interleaved, non-contiguous block tables, so a wrong table lookup cannot go unnoticed.
    tables = [list(range(i, 63, 3)) for i in range(3)]
    logits = _paged_prefill(ours, cache, prompts, tables, block_size, split_at=90)
    ends = torch.tensor([len(prompts[0]), len(prompts[1]), len(prompts[2]) - 90]).cumsum(0) - 1
    ours_steps, tokens = [logits[ends]], [logits[ends].argmax(-1)]
    lengths = [len(p) for p in prompts]
    for _ in range(steps - 1):
        batch = ForwardBatch.build([[int(t)] for t in tokens[-1]], lengths, tables, block_size)
        step_logits = ours.forward_logits(batch, cache)
        lengths = [n + 1 for n in lengths]
        ours_steps.append(step_logits)
        tokens.append(step_logits.argmax(-1))
    ours_tokens = torch.stack(tokens, dim=1)
    for i, prompt in enumerate(prompts):
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
        )
        ref_logits = torch.cat(out.logits)  # [steps, vocab]
        ours_logits = torch.stack([s[i] for s in ours_steps])
        assert (ours_logits - ref_logits).abs().max().item() <= TOL
        assert ours_tokens[i].tolist() == out.sequences[0, len(prompt):].tolist()
