"""SpecPolicy picks the number of drafts that gave the most tokens per second, per batch size."""

from __future__ import annotations

from glmserve.engine.spec_policy import SpecPolicy


def _feed(policy: SpecPolicy, batch: int, seconds: dict[int, float], tokens: dict[int, float], rounds: int = 5):
    for _ in range(rounds):
        for k, sec in seconds.items():  # sec: the whole cost of a step with k drafts
            policy.record_step(batch, k, sec, tokens[k] * batch)
            policy.record_drafting(batch, k, 0.0)


def test_measures_each_choice_first():
    policy = SpecPolicy(max_drafts=2)
    assert policy.choose(1) == 0
    policy.record_step(1, 0, 0.01, 1)
    assert policy.choose(1) == 1
    policy.record_step(1, 1, 0.01, 2)
    assert policy.choose(1) == 1  # drafting 1 not measured yet
    policy.record_drafting(1, 1, 0.002)
    assert policy.choose(1) == 2


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


def test_explores_a_neighbour_less_often_while_the_best_choice_holds():
    policy = SpecPolicy(max_drafts=3, explore_every=4)
    _feed(policy, 32, {0: 0.05, 1: 0.09, 2: 0.13, 3: 0.17}, {0: 1, 1: 1.7, 2: 2.0, 3: 2.1})
    picks = [policy.choose(32) for _ in range(60)]
    assert [i + 1 for i, k in enumerate(picks) if k] == [4, 12, 28, 60]  # waits 4, 8, 16, 32
    assert set(picks) == {0, 1}


def test_a_new_best_choice_resets_the_wait():
    policy = SpecPolicy(max_drafts=1, explore_every=4)
    _feed(policy, 8, {0: 0.010, 1: 0.030}, {0: 1, 1: 1.7})
    picks = [policy.choose(8) for _ in range(12)]
    assert [i + 1 for i, k in enumerate(picks) if k] == [4, 12]
    _feed(policy, 8, {0: 0.010, 1: 0.011}, {0: 1, 1: 1.7}, rounds=30)  # now one draft pays
    picks = [policy.choose(8) for _ in range(8)]
    assert [i + 1 for i, k in enumerate(picks) if not k] == [4]  # explores after 4 steps again


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
