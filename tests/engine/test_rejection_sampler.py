import pytest
import torch

from glmserve.core.generation import SamplingParams
from glmserve.engine.rejection_sampler import verify
from glmserve.engine.sampler import make_generator, processed_probs

GREEDY = SamplingParams(temperature=0)
V = 6


def _target_with_argmax(rows: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """Target logits [B, len(row), vocab] whose argmax at each position is the given token."""
    torch.manual_seed(0)
    logits = torch.randn(len(rows), len(rows[0]), vocab)
    return logits + 10 * torch.nn.functional.one_hot(torch.tensor(rows), vocab)


@pytest.mark.parametrize(
    "drafts, best, accepted",
    [
        ([3, 1, 4], [3, 1, 4, 5], [3, 1, 4, 5]),  # all accepted + bonus
        ([3, 1, 4], [2, 1, 4, 5], [2]),  # first rejected -> correction only
        ([3, 1, 4], [3, 0, 4, 5], [3, 0]),  # middle rejected
        ([3, 1, 4], [3, 1, 7, 5], [3, 1, 7]),  # last rejected
        ([], [6], [6]),  # k = 0
    ],
)
def test_greedy_exact(drafts, best, accepted):
    target = _target_with_argmax([best])
    out = verify(torch.tensor([drafts], dtype=torch.long), None, target, [GREEDY])
    assert out.accepted == [accepted]
    assert out.num_accepted_drafts.tolist() == [len(accepted) - 1]


def test_greedy_batch_ignores_draft_probs_and_mixes_with_sampled_rows():
    target = _target_with_argmax([[3, 1, 4, 5], [2, 1, 4, 5], [0, 0, 0, 0]])
    drafts = torch.tensor([[3, 1, 4], [3, 1, 4], [0, 0, 0]])
    draft_probs = torch.full((3, 3, 8), 1 / 8)
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.01)]  # near-greedy sampled row
    out = verify(drafts, draft_probs, target, params, [None, None, make_generator(0)])
    assert out.accepted == [[3, 1, 4, 5], [2], [0, 0, 0, 0]]
    assert out.num_accepted_drafts.tolist() == [3, 0, 3]


def _spec_trial(n: int, k: int, params: list[SamplingParams], seed: int):
    """n rows of one speculative step with random target and draft logits (the same for every row
    of a given params), drafts drawn from the processed draft distribution q."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(1, k + 1, V, generator=gen) * 1.5
    draft = torch.randn(1, k, V, generator=gen) * 1.5
    draft[0, :, 0] = -float("inf")  # q has no mass on token 0, p does
    rows = [params[i % len(params)] for i in range(n)]
    q = processed_probs(draft.expand(n, k, V), rows)
    p = processed_probs(target.expand(n, k + 1, V), rows)
    drafts = torch.multinomial(q.reshape(n * k, V), 1, generator=gen).reshape(n, k)
    torch.manual_seed(seed)
    out = verify(drafts, q, target.expand(n, k + 1, V), rows)
    return out, p, q, drafts


def _tv(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


def test_first_and_second_emitted_tokens_follow_the_target():
    # Two temperatures (and a top-k row) in one batch; each must match its own target distribution.
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=4)]
    n, k = 40_000, 3
    out, p, q, _ = _spec_trial(n, k, params, seed=3)
    for r in range(len(params)):
        rows = range(r, n, len(params))
        first = [out.accepted[i][0] for i in rows]
        assert _tv(first, p[r, 0]) < 0.02
        # The second token is emitted in this step only when draft 1 was accepted; whatever the
        # draft was, it must then follow the target at position 1.
        second = [out.accepted[i][1] for i in rows if len(out.accepted[i]) >= 2]
        assert len(second) > 5_000
        assert _tv(second, p[r, 1]) < 0.02
        # Acceptance rate of draft 1 is sum_x min(p, q).
        rate = len(second) / len(rows)
        assert rate == pytest.approx(torch.minimum(p[r, 0], q[r, 0]).sum().item(), abs=0.015)
    assert all(1 <= len(a) <= k + 1 for a in out.accepted)
    assert out.num_accepted_drafts.tolist() == [len(a) - 1 for a in out.accepted]


def test_deterministic_draft_without_probs_is_lossless():
    n = 30_000
    target = torch.tensor([[[0.5, 1.0, -0.3, 2.0, 0.0, -1.0]]]).expand(n, 1, V)
    params = [SamplingParams(temperature=1.0, top_p=0.95)] * n
    torch.manual_seed(4)
    out = verify(torch.full((n, 1), 3), None, target.repeat(1, 2, 1), params)
    p = processed_probs(target[:1, 0], params[:1])[0]
    assert _tv([a[0] for a in out.accepted], p) < 0.02


def test_k_zero_samples_from_the_target():
    n = 30_000
    target = torch.tensor([[[0.5, 1.0, -0.3, 2.0, 0.0, -1.0]]]).expand(n, 1, V)
    params = [SamplingParams(temperature=0.9)] * n
    torch.manual_seed(5)
    out = verify(torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, 0, V), target, params)
    assert all(len(a) == 1 for a in out.accepted) and out.num_accepted_drafts.sum() == 0
    assert _tv([a[0] for a in out.accepted], torch.softmax(target[0, 0] / 0.9, -1)) < 0.02


def test_seeded_rows_are_reproducible():
    torch.manual_seed(6)
    target, draft_logits = torch.randn(4, 5, 50), torch.randn(4, 4, 50)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(4)]
    q = processed_probs(draft_logits, params)
    drafts = torch.multinomial(q.reshape(16, 50), 1).reshape(4, 4)

    def run(seeds):
        gens = [make_generator(s) for s in seeds]
        return verify(drafts, q, target, params, gens).accepted

    assert run(range(4)) == run(range(4))
    assert [run(range(s, s + 4)) for s in range(0, 40, 4)].count(run(range(4))) == 1


def test_shape_errors():
    with pytest.raises(ValueError, match="^target_logits:"):
        verify(torch.zeros(1, 2, dtype=torch.long), None, torch.zeros(1, 2, 5), [GREEDY])
    with pytest.raises(ValueError, match="^draft_probs:"):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 4), torch.zeros(1, 3, 5), [GREEDY])
