import pytest

from glmserve.core.generation import FINISH_REASONS, SamplingParams, TokenEvent


def test_defaults_are_valid_and_hashable():
    p = SamplingParams()
    assert p.max_tokens == 256 and p.temperature == 1.0 and not p.is_greedy
    assert hash(p) == hash(SamplingParams())


def test_sequences_are_stored_as_tuples():
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])
    assert p.stop == ("a", "b") and p.stop_token_ids == (1, 2)
    assert SamplingParams(stop="###").stop == ("###",)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("seed", 2**64),
        ("seed", 1.0),
        ("stop_token_ids", (1, -1)),
        ("stop_token_ids", ("a",)),
        ("stop", ("ok", "")),
        ("stop", tuple(str(i) for i in range(17))),
        ("stop", (1,)),
        ("ignore_eos", 1),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "kwargs, greedy",
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.0, "top_p": 0.5}, True),
        ({"temperature": 1e-7}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.7}, False),
        ({"top_k": 0}, False),
        ({"top_k": -1, "top_p": 0.1}, False),
    ],
)
def test_is_greedy(kwargs, greedy):
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_boundaries_accepted():
    SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=0, seed=-(2**63), logprobs=0)
    SamplingParams(top_k=1, seed=2**64 - 1, logprobs=20, stop=tuple("abcdefghijklmnop"))


def test_token_event_is_finished_by_its_reason():
    event = TokenEvent("r", [5, 6], "ab", [-0.1, -0.2], [[(5, -0.1)], [(6, -0.2)]])
    assert not event.finished and event.error is None
    done = TokenEvent.ended("r", "error", "boom", num_cached_tokens=3)
    assert done.finished and done.token_ids == [] and done.error == "boom" and done.num_cached_tokens == 3
    with pytest.raises(ValueError, match="^finish_reason:"):
        TokenEvent.ended("r", "done")
    assert FINISH_REASONS == {"stop", "length", "abort", "error"}
