"""SpecPolicy picks the number of drafts that gave the most tokens per second, per batch size."""

from __future__ import annotations

import random

import pytest

from glmserve.engine.spec_policy import PROBE_STEPS, SpecPolicy


def _feed(policy: SpecPolicy, batch: int, seconds: dict[int, float], tokens: dict[int, float], rounds: int = 5):
    for _ in range(rounds):
        for k, sec in seconds.items():  # sec: the whole cost of a step with k drafts
            policy.record_step(batch, k, sec, tokens[k] * batch)
            policy.record_drafting(batch, k, 0.0)


def test_measures_each_choice_first_for_a_few_steps():
    policy = SpecPolicy(max_drafts=2)
    assert [policy.choose(1) for _ in range(PROBE_STEPS)] == [0] * PROBE_STEPS
    for _ in range(PROBE_STEPS):
        policy.record_step(1, 0, 0.01, 1)
    assert [policy.choose(1) for _ in range(PROBE_STEPS)] == [1] * PROBE_STEPS
    for _ in range(PROBE_STEPS):
        policy.record_step(1, 1, 0.01, 2)
        policy.record_drafting(1, 1, 0.002)
    assert policy.choose(1) == 2  # one draft paid: two are tried next


def test_speculates_when_verification_is_nearly_free():
    policy = SpecPolicy(max_drafts=3, explore_every=10**9)
    _feed(policy, 1, {0: 0.010, 1: 0.011, 2: 0.012, 3: 0.014}, {0: 1, 1: 1.7, 2: 2.0, 3: 2.1})
    assert policy.choose(1) == 2  # 2.0 / 0.012 beats 1.7 / 0.011 and 2.1 / 0.014


def test_stops_speculating_when_it_does_not_pay():
    policy = SpecPolicy(max_drafts=3, explore_every=10**9)
    _feed(policy, 32, {0: 0.05, 1: 0.09, 2: 0.13, 3: 0.17}, {0: 1, 1: 1.7, 2: 2.0, 3: 2.1})
    assert policy.choose(32) == 0
    _feed(policy, 1, {0: 0.010, 1: 0.011, 2: 0.012, 3: 0.014}, {0: 1, 1: 1.7, 2: 2.0, 3: 2.1})
    assert policy.choose(1) == 2 and policy.choose(32) == 0  # buckets are separate


def test_explores_less_often_while_the_best_choice_holds():
    policy = SpecPolicy(max_drafts=3, explore_every=4)
    _feed(policy, 32, {0: 0.05, 1: 0.09, 2: 0.13, 3: 0.17}, {0: 1, 1: 1.7, 2: 2.0, 3: 2.1})
    picks = [policy.choose(32) for _ in range(80)]
    starts = [i + 1 for i, k in enumerate(picks) if k and not (i and picks[i - 1])]
    assert starts == [4, 15, 34, 69]  # probes of PROBE_STEPS steps after waits of 4, 8, 16, 32 steps
    assert sum(1 for k in picks if k) == 4 * PROBE_STEPS


def test_a_new_best_choice_is_checked_again_soon():
    policy = SpecPolicy(max_drafts=1, explore_every=8)
    _feed(policy, 8, {0: 0.010, 1: 0.030}, {0: 1, 1: 1.7})
    assert [policy.choose(8) for _ in range(4)] == [0] * 4
    _feed(policy, 8, {0: 0.010, 1: 0.011}, {0: 1, 1: 1.7}, rounds=10)  # now one draft pays
    picks = [policy.choose(8) for _ in range(20)]
    assert picks[:PROBE_STEPS] == [1] * PROBE_STEPS  # switches, then ...
    assert 0 in picks[: 3 * PROBE_STEPS]  # ... re-checks k = 0 within a few steps, not after the old wait
    assert picks[-PROBE_STEPS:] == [1] * PROBE_STEPS


@pytest.mark.parametrize("seed", range(4))
def test_noisy_step_times_do_not_turn_speculation_on_at_a_large_batch(seed):
    """Step times with 15% noise and 5% of steps twice as slow: the policy still keeps k = 0 almost
    always where every k > 0 loses 19-24% (as at batch 32 on the bundled model)."""
    rng = random.Random(seed)
    step, draft, tokens = [40, 70, 75, 80], [0.05, 14, 23.5, 33], [1, 1.6, 2.0, 2.2]
    policy, k, picks = SpecPolicy(max_drafts=3), 0, []
    for _ in range(1000):
        noise = rng.lognormvariate(0, 0.15) * (2 if rng.random() < 0.05 else 1)
        policy.record_step(32, k, step[k] * noise, tokens[k] * 32)
        k = policy.choose(32)
        picks.append(k)
        policy.record_drafting(32, k, draft[k] * rng.lognormvariate(0, 0.15))
    assert picks[100:].count(0) >= 0.93 * 900


def test_a_marginal_gain_does_not_turn_speculation_on():
    policy = SpecPolicy(max_drafts=1, explore_every=10**9)
    _feed(policy, 8, {0: 0.010, 1: 0.0168}, {0: 1, 1: 1.7})  # 1.2% more tokens/s than k = 0
    assert policy.choose(8) == 0
    _feed(policy, 8, {0: 0.010, 1: 0.0150}, {0: 1, 1: 1.7}, rounds=30)  # 13% more
    assert policy.choose(8) == 1


def test_drafting_is_charged_to_the_drafts_it_made():
    """A step that verified nothing but then drafted is a k = 0 forward plus k = 1 drafting."""
    policy = SpecPolicy(max_drafts=1, explore_every=10**9)
    for _ in range(10):
        policy.record_step(32, 0, 0.050, 32)
        policy.record_drafting(32, 1, 0.030)  # what the next step's drafts cost
        policy.record_step(32, 1, 0.055, 32 * 1.7)
        policy.record_drafting(32, 0, 0.0)
    assert policy.choose(32) == 0  # 1.7 / 0.085 < 1 / 0.050, though 1.7 / 0.055 > 1 / 0.080


def test_longer_drafts_are_tried_only_while_drafting_pays():
    policy = SpecPolicy(max_drafts=3, explore_every=10**9)
    _feed(policy, 32, {0: 0.05, 1: 0.09}, {0: 1, 1: 1.7})  # one draft loses
    assert [policy.choose(32) for _ in range(5)] == [0] * 5  # k = 2 and 3 are never tried


def test_steps_that_will_not_be_measured_get_a_settled_choice_and_no_probe():
    policy = SpecPolicy(max_drafts=2, explore_every=4)
    assert policy.choose(32, measurable=False) == 0  # nothing known yet
    _feed(policy, 2, {0: 0.010, 1: 0.011, 2: 0.030}, {0: 1, 1: 1.7, 2: 2.0})
    assert policy.choose(2) == 1
    assert policy.choose(3, measurable=False) == 1  # same bucket
    assert policy.choose(8, measurable=False) == 1  # nearest measured bucket
    assert [policy.choose(32, measurable=False) for _ in range(20)] == [1] * 20  # never probes
    assert policy.choose(32) == 0  # a measurable step starts measuring the new bucket


def test_a_draft_length_that_only_ties_is_not_extended():
    policy = SpecPolicy(max_drafts=3, explore_every=10**9)
    _feed(policy, 32, {0: 0.05, 1: 0.05 * 1.7 / 1.02}, {0: 1, 1: 1.7})  # k = 1 is 2% faster: a tie
    assert [policy.choose(32) for _ in range(5)] == [0] * 5  # k = 2 is never probed
