import random

import pytest

from glmserve.core.generation import SamplingParams
from glmserve.core.stop_checker import StopChecker, TextCheck, TokenCheck

EOS = 2


def test_eos_stops_is_invisible_and_drops_later_tokens():
    checker = StopChecker(SamplingParams(), eos_token_ids=[EOS])
    assert checker.check_tokens([10, 11]) == TokenCheck(2, 2, None)
    assert checker.check_tokens([12, EOS, 13]) == TokenCheck(2, 1, "stop", EOS)
    assert checker.num_tokens == 4 and checker.finish_reason == "stop" and checker.stop_reason is None
    with pytest.raises(RuntimeError):
        checker.check_tokens([1])


def test_ignore_eos_continues_but_stop_token_ids_still_stop():
    checker = StopChecker(SamplingParams(ignore_eos=True, stop_token_ids=(7,)), eos_token_ids=[EOS])
    assert checker.check_tokens([EOS, 5]) == TokenCheck(2, 2, None)
    assert checker.check_tokens([7]) == TokenCheck(1, 0, "stop", 7)
    assert checker.stop_reason == 7


def test_max_tokens_truncates_a_multi_token_step():
    checker = StopChecker(SamplingParams(max_tokens=5), eos_token_ids=[EOS])
    assert checker.check_tokens([1, 1, 1]) == TokenCheck(3, 3, None)
    assert checker.check_tokens([1, 1, 1, 1]) == TokenCheck(2, 2, "length")
    assert checker.num_tokens == 5 and checker.finish_reason == "length"


def test_eos_as_the_last_allowed_token_is_stop_and_eos_past_the_limit_is_ignored():
    checker = StopChecker(SamplingParams(max_tokens=2), eos_token_ids=[EOS])
    assert checker.check_tokens([1, EOS]) == TokenCheck(2, 1, "stop", EOS)
    checker = StopChecker(SamplingParams(max_tokens=2), eos_token_ids=[EOS])
    assert checker.check_tokens([1, 1, EOS]) == TokenCheck(2, 2, "length")


def test_stop_string_straddling_chunks_truncates_before_it():
    checker = StopChecker(SamplingParams(stop=("WORLD",)))
    assert checker.check_text("Hel") == TextCheck(None, 3, 3)
    assert checker.check_text("Hello WO") == TextCheck(None, 8, 6)  # "WO" held back
    result = checker.check_text("Hello WORLD! more")
    assert result == TextCheck("stop", 6, 6, "WORLD")
    assert checker.finish_reason == "stop" and checker.stop_reason == "WORLD"
    assert checker.check_text("Hello WORLD! more and more") is result  # final


def test_hold_back_only_what_could_start_a_stop_string():
    checker = StopChecker(SamplingParams(stop=("<end>", "xyz")))
    assert checker.check_text("abc<").stream_end == 3
    assert checker.check_text("abc<e").stream_end == 3
    assert checker.check_text("abc<e!").stream_end == 6  # "<e!" can no longer become "<end>"
    assert checker.check_text("abc<e!xx").stream_end == 7  # "x" could start "xyz", "xx" cannot
    assert checker.check_text("abc<e!xxy").stream_end == 7
    assert checker.check_text("abc<e!xxyq").stream_end == 10
    assert StopChecker(SamplingParams()).check_text("abc<").stream_end == 4


def test_repeated_prefix_hold_back():
    checker = StopChecker(SamplingParams(stop=("aab",)))
    assert checker.check_text("xaa").stream_end == 1
    assert checker.check_text("xaaa").stream_end == 2
    assert checker.check_text("xaaab") == TextCheck("stop", 2, 2, "aab")


def test_earliest_completed_stop_wins_regardless_of_order():
    for stops in (("abcd", "bc"), ("bc", "abcd")):
        assert StopChecker(SamplingParams(stop=stops)).check_text("xabcd") == TextCheck("stop", 2, 2, "bc")
    # same end: the longer one (earlier start) wins
    assert StopChecker(SamplingParams(stop=("cd", "bcd"))).check_text("abcd").text_end == 1


def test_stop_string_overrides_length_and_no_hold_back_once_finished():
    checker = StopChecker(SamplingParams(max_tokens=2, stop=("##", "!")))
    assert checker.check_tokens([5, 6]).finish_reason == "length"
    assert checker.check_text("ab#") == TextCheck(None, 3, 3)  # finished: flush the "#"
    checker = StopChecker(SamplingParams(max_tokens=2, stop=("##",)))
    checker.check_tokens([5, 6])
    assert checker.check_text("a##b").finish_reason == "stop"
    assert (checker.finish_reason, checker.stop_reason) == ("stop", "##")


def test_text_must_only_grow():
    checker = StopChecker(SamplingParams(stop=("z",)))
    checker.check_text("abc")
    with pytest.raises(ValueError, match="^text:"):
        checker.check_text("ab")


def test_result_is_independent_of_chunking_and_streaming_is_monotonic():
    rng = random.Random(0)
    stops = ("aab", "ba", "abab", "bbbb")
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 20)))
        whole = StopChecker(SamplingParams(stop=stops)).check_text(text)
        checker, streamed, end = StopChecker(SamplingParams(stop=stops)), 0, 0
        while end < len(text) and not checker.finished:
            end = min(len(text), end + rng.randint(1, 4))
            result = checker.check_text(text[:end])
            assert result.stream_end >= streamed
            streamed = result.stream_end
        if whole.finish_reason:
            assert result == whole
        else:
            assert result.text_end == len(text) and result.finish_reason is None
            # what is held back is a proper prefix of some stop string
            held = text[result.stream_end :]
            assert held == "" or any(s.startswith(held) and s != held for s in stops)
