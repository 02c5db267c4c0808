"""SpecPolicy picks the number of drafts that gives the most tokens per second, per batch size.

`_run` drives the policy as the engine does: each step's forward verifies the previous step's drafts;
then the next k is chosen, and the forward and the drafting of that k are recorded.
"""

from __future__ import annotations

import random

import pytest

from glmserve.engine.spec_policy import PROBE_PAIRS, SpecPolicy

PROBE = 2 * PROBE_PAIRS  # steps of a probe

# Costs of one step (ms of the forward that verified k drafts, ms of drafting k) and tokens a request
# gains per step, shaped like the bundled model on 2 cores.
LARGE_BATCH = ([40, 70, 75, 80], [0.05, 14, 23.5, 33], [1, 1.6, 2.0, 2.2])  # every k > 0 loses 19-24%
SMALL_BATCH = ([12, 13, 14, 15.5], [0.05, 2.5, 5, 7.5], [1, 1.7, 2.0, 2.2])  # k = 1 best, k = 2 close


def _run(policy, batch, costs, steps, noise=0.0, spike=0.0, seed=0, measurable=True, start_k=0):
    step_ms, draft_ms, tokens = costs
    rng = random.Random(seed)
    k, picks = start_k, []

    def jitter(ms: float) -> float:
        return ms * rng.lognormvariate(0, noise) * (2 if rng.random() < spike else 1) / 1000

    for _ in range(steps):  # as Engine.step: the forward, the next choice, then both recorded
        forward = jitter(step_ms[k])
        verified, k = k, policy.choose(batch, measurable)
        picks.append(k)
        policy.record_step(batch, verified, forward, tokens[verified] * batch)
        policy.record_drafting(batch, k, jitter(draft_ms[k]))
    return picks


def _runs(picks: list[int]) -> list[tuple[int, int]]:
    """(k, length) of each run of equal picks."""
    out: list[tuple[int, int]] = []
    for k in picks:
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1] + 1)
        else:
            out.append((k, 1))
    return out


def test_a_new_batch_size_probes_one_draft_against_none():
    picks = _run(SpecPolicy(max_drafts=3), 32, LARGE_BATCH, PROBE + 10)
    assert picks[:PROBE] == [1, 0] * PROBE_PAIRS  # alternating: both sides see the same machine
    assert picks[PROBE:] == [0] * 10  # one draft lost


def test_speculates_when_drafts_pay_and_finds_the_best_length():
    picks = _run(SpecPolicy(max_drafts=3), 1, SMALL_BATCH, 400)
    assert picks[: 2 * PROBE] == [1, 0] * PROBE_PAIRS + [2, 1] * PROBE_PAIRS  # k = 1 won: try k = 2
    assert picks[50:].count(1) >= 0.9 * 350  # k = 1: 1.7 / 15.5 ms beats 2.0 / 19 ms and 2.2 / 23 ms


def test_stops_speculating_where_it_does_not_pay():
    picks = _run(SpecPolicy(max_drafts=3), 32, LARGE_BATCH, 400)
    assert picks[PROBE:].count(0) >= 0.95 * (400 - PROBE)
    assert 2 not in picks and 3 not in picks  # one draft lost: longer drafts are never tried


def test_probes_back_off_while_the_choice_holds():
    picks = _run(SpecPolicy(max_drafts=3, explore_every=8), 32, LARGE_BATCH, 300)
    probe_starts = [i for i, k in enumerate(picks) if k and (i < 2 or not picks[i - 2])]
    gaps = [b - a for a, b in zip(probe_starts, probe_starts[1:], strict=False)]
    assert len(gaps) >= 3 and all(later > earlier for earlier, later in zip(gaps, gaps[1:], strict=False))
    assert picks.count(1) == PROBE_PAIRS * len(probe_starts) and set(picks) == {0, 1}


def test_a_marginal_gain_does_not_turn_speculation_on():
    # k = 1 gives 5% more tokens/s than k = 0: inside the margin, not worth speculating.
    costs = ([10, 15.0, 99, 99], [0.05, 1.19, 99, 99], [1, 1.7, 1, 1])
    picks = _run(SpecPolicy(max_drafts=1), 8, costs, 200)
    assert picks[PROBE:].count(0) >= 0.9 * (200 - PROBE)  # all but the backed-off probes


def test_drafting_is_charged_to_the_drafts_it_made():
    """A cheap verification does not hide expensive drafting: 1.7 / (55 + 30) ms < 1 / 50 ms."""
    costs = ([50, 55, 99, 99], [0.05, 30, 99, 99], [1, 1.7, 1, 1])
    picks = _run(SpecPolicy(max_drafts=1), 32, costs, 200)
    assert picks[PROBE:].count(0) >= 0.9 * (200 - PROBE)


def test_a_switch_is_rechecked_soon():
    """When drafts start to pay (acceptance rose), the policy switches at its next probe, then soon
    probes the old choice again rather than waiting the backed-off interval."""
    policy = SpecPolicy(max_drafts=1, explore_every=8)
    _run(policy, 8, ([10, 30, 0, 0], [0.05, 5, 0, 0], [1, 1.7, 0, 0]), 100)  # drafts lose
    picks = _run(policy, 8, ([10, 11, 0, 0], [0.05, 1, 0, 0], [1, 1.7, 0, 0]), 300)
    switch = next(i for i in range(len(picks)) if picks[i : i + PROBE + 1] == [1, 0] * PROBE_PAIRS + [1])
    after = picks[switch + PROBE :]
    assert after.count(1) >= 0.85 * len(after)  # it switched to k = 1 ...
    assert 0 in after[1 : 4 * PROBE_PAIRS]  # ... and re-checked k = 0 within a few steps


def test_steps_that_will_not_be_measured_get_a_settled_choice_and_no_probe():
    policy = SpecPolicy(max_drafts=3)
    assert policy.choose(32, measurable=False) == 0  # nothing known yet
    _run(policy, 2, SMALL_BATCH, 100)
    assert policy.choose(3, measurable=False) == 1  # same bucket
    assert policy.choose(8, measurable=False) == 1  # nearest measured bucket
    assert _run(policy, 32, SMALL_BATCH, 50, measurable=False, start_k=1) == [1] * 50  # never probes
    assert policy.choose(32) == 1  # a new bucket starts from the nearest measured one's choice


@pytest.mark.parametrize("seed", range(4))
def test_noisy_step_times_keep_the_right_choice(seed):
    """15% noise on every time and 5% of steps twice as slow: one slow step must not flip the choice."""
    large = _run(SpecPolicy(max_drafts=3), 32, LARGE_BATCH, 1000, noise=0.15, spike=0.05, seed=seed)
    assert large[100:].count(0) >= 0.95 * 900
    small = _run(SpecPolicy(max_drafts=3), 1, SMALL_BATCH, 1000, noise=0.15, spike=0.05, seed=seed)
    assert sum(1 for k in small[100:] if k) >= 0.9 * 900  # speculates; k = 1 and 2 are within 4%


def test_rejects_bad_max_drafts():
    with pytest.raises(ValueError, match="max_drafts"):
        SpecPolicy(max_drafts=-1)


def test_a_probe_missing_samples_ends_anyway():
    """Steps that are not measured (a request finished, a prompt joined) can leave a probe without
    some samples for good: it still ends, and later probes happen."""
    policy = SpecPolicy(max_drafts=1, explore_every=8)
    k, picks = 0, []
    for step in range(200):
        verified, k = k, policy.choose(1)
        picks.append(k)
        policy.record_step(1, verified, 0.012 if verified else 0.010, 1.7 if verified else 1)
        if step != 2:  # the second drafting of the first probe is never recorded
            policy.record_drafting(1, k, 0.003 if k else 0.0)
    probe_starts = [i for i, k in enumerate(picks) if k and (i < 2 or not picks[i - 2])]
    assert len(probe_starts) >= 3


def test_a_shrinking_batch_starts_each_new_size_from_the_nearest_choice():
    """Chat batches shrink through several sizes as requests finish: a new size starts from the nearest
    measured size's choice and probes only after the usual wait, not at once."""
    policy = SpecPolicy(max_drafts=3, explore_every=24)
    _run(policy, 32, LARGE_BATCH, 100)
    assert _run(policy, 16, LARGE_BATCH, 20) == [0] * 20
    assert _run(policy, 8, LARGE_BATCH, 20) == [0] * 20
    assert 1 in _run(policy, 8, LARGE_BATCH, 20)  # the wait is over: now it probes

