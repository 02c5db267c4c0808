import math

import pytest
import torch

from glmserve.core.generation import SamplingParams
from glmserve.engine.sampler import Sampler, make_generator, sample_from_probs
from glmserve.model.greedy import greedy_ids

GREEDY = SamplingParams(temperature=0)


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) if p > 0 else float("-inf") for p in probs]])


def _support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs[0] > 0).flatten().tolist())


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts.double() / counts.sum() - probs.double()).abs().sum().item()


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -3.0]])
    out = Sampler().sample(logits, [GREEDY] * 3)
    assert out.token_ids.tolist() == [1, 0, 2]
    # top_k=1 is greedy too, even with a temperature
    assert Sampler().sample(logits, [SamplingParams(top_k=1)] * 3).token_ids.tolist() == [1, 0, 2]


def test_logprobs_are_from_raw_logits_and_top_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.0, 4.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.3, top_k=2)]
    out = Sampler().sample(logits, params, [None, make_generator(1)])
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_logprobs[1] is None
    (i0, v0), (i1, v1) = out.top_logprobs[0]
    assert (i0, i1) == (0, 1)
    assert v0 == pytest.approx(raw[0, 0].item()) and v1 == pytest.approx(raw[0, 1].item())
    assert Sampler().sample(logits[:1], [SamplingParams(logprobs=0)]).top_logprobs == [[]]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0)

    def draws(seed: int, others: int = 0) -> list[int]:
        gen = make_generator(seed)
        batch = torch.cat([logits, torch.randn(others, 1000)])
        return [
            Sampler().sample(batch, [p] * (1 + others), [gen] + [None] * others).token_ids[0].item()
            for _ in range(20)
        ]

    assert draws(7) == draws(7) == draws(7, others=3)
    assert draws(7) != draws(8)


def test_top_k_keeps_exactly_the_k_largest():
    sampler = Sampler()
    probs = sampler.processed_probs(torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]]), [SamplingParams(top_k=2)])
    assert _support(probs) == {1, 2}
    assert probs.sum().item() == pytest.approx(1.0)
    # ties at the threshold are all kept; k >= V keeps everything
    ties = sampler.processed_probs(torch.tensor([[5.0, 3.0, 3.0, 0.0]]), [SamplingParams(top_k=2)])
    assert _support(ties) == {0, 1, 2}
    assert _support(sampler.processed_probs(torch.zeros(1, 4), [SamplingParams(top_k=50)])) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "top_p, top_k, kept",
    [
        (0.4, -1, {0}),
        (0.6, -1, {0, 1}),
        (0.75, -1, {0, 1, 2}),
        (0.8, -1, {0, 1, 2}),
        (0.96, -1, {0, 1, 2, 3, 4}),
        (1.0, -1, {0, 1, 2, 3, 4}),
        # top-k first: renormalised [.588, .235, .176] -> 0.8 needs only two tokens
        (0.8, 3, {0, 1}),
    ],
)
def test_top_p_keeps_the_smallest_nucleus(top_p, top_k, kept):
    logits = _logits([0.15, 0.5, 0.2, 0.1, 0.05])[:, [1, 2, 0, 3, 4]]  # ids sorted by prob: 0..4
    probs = Sampler().processed_probs(logits, [SamplingParams(top_p=top_p, top_k=top_k)])
    assert _support(probs) == kept
    base = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    expected = torch.zeros(5)
    expected[list(kept)] = base[list(kept)] / base[list(kept)].sum()
    assert torch.allclose(probs[0], expected, atol=1e-6)


def test_processed_probs_temperature_mixed_rows_and_3d():
    torch.manual_seed(1)
    logits = torch.randn(3, 2, 7)
    params = [SamplingParams(temperature=0.5), GREEDY, SamplingParams(temperature=2.0, top_k=3)]
    probs = Sampler().processed_probs(logits, params)
    assert probs.shape == (3, 2, 7) and probs.dtype == torch.float32
    assert torch.allclose(probs.sum(-1), torch.ones(3, 2))
    assert torch.allclose(probs[0], torch.softmax(logits[0] / 0.5, -1))
    assert torch.equal(probs[1], torch.nn.functional.one_hot(logits[1].argmax(-1), 7).float())
    for t in range(2):
        assert torch.equal(probs[2, t], Sampler().processed_probs(logits[2, t : t + 1], params[2:])[0])
        assert (probs[2, t] > 0).sum().item() == 3


def test_sampled_frequencies_match_the_processed_distribution():
    torch.manual_seed(2)
    n = 40_000
    logits = torch.tensor([[0.3, -1.0, 2.0, 0.0, 1.2, -0.4]]).expand(n, 6)
    # mixed batch: greedy rows interleaved with two different processings
    params_a = SamplingParams(temperature=0.8, top_p=0.9)
    params_b = SamplingParams(temperature=1.5, top_k=4)
    params = [params_a, params_b, GREEDY, params_b] * (n // 4)
    out = Sampler().sample(logits, params)
    tokens = out.token_ids
    assert (tokens[2::4] == 2).all()
    for rows, p in ((tokens[0::4], params_a), (torch.cat([tokens[1::4], tokens[3::4]]), params_b)):
        target = Sampler().processed_probs(logits[:1], [p])[0]
        counts = torch.bincount(rows, minlength=6)
        assert counts[target == 0].sum() == 0
        assert _tv(counts, target) < 0.02


def test_sample_from_probs_per_row_generators_follow_the_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(3000, 4)
    gens = [make_generator(i) for i in range(3000)]
    tokens = sample_from_probs(probs, gens)
    counts = torch.bincount(tokens, minlength=4)
    assert counts[1] == 0 and _tv(counts, probs[0]) < 0.04
    assert torch.equal(tokens, sample_from_probs(probs, [make_generator(i) for i in range(3000)]))


def test_shape_errors():
    with pytest.raises(ValueError, match="^logits:"):
        Sampler().sample(torch.zeros(2, 5), [GREEDY])
    with pytest.raises(ValueError, match="^generators:"):
        Sampler().sample(torch.zeros(2, 5), [GREEDY] * 2, [None])


def test_greedy_ids_is_argmax_with_ties_and_nan_at_the_first():
    nan = float("nan")
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [nan, 1.0, nan, 2.0], [5.0, 5.0, 5.0, 5.0]])
    assert greedy_ids(logits).tolist() == logits.argmax(dim=-1).tolist() == [1, 0, 0]
    many = torch.randint(0, 3, (64, 8192), generator=torch.Generator().manual_seed(0)).float()
    assert torch.equal(greedy_ids(many), many.argmax(dim=-1))
