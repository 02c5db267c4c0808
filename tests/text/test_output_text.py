"""OutputText: the one place output text is made. Deltas join to the visible text, special tokens
are hidden except the requested ones, stop strings end the text wherever the tokens split it."""

from __future__ import annotations

import pytest

from glmserve.core.generation import SamplingParams
from glmserve.core.stop_checker import StopChecker
from glmserve.text.output_text import OutputText
from glmserve.text.special_tokens import TOOL_MARKUP
from glmserve.text.tokenizer import Tokenizer
from tools.tiny_tokenizer import save_tokenizer, train_tokenizer

TEXT = "Let me look. <tool_call>read_file<arg_key>path</arg_key><arg_value>ü.py</arg_value></tool_call> done 😀"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("output-text")
    save_tokenizer(train_tokenizer([TEXT] * 3, vocab_size=300), d)
    return Tokenizer.from_dir(d)


def _run(tok: Tokenizer, params: SamplingParams, ids: list[int], split: int) -> tuple[list[str], OutputText, StopChecker]:
    """Push ``ids`` ``split`` at a time, as an engine step would (stop checks first)."""
    checker = StopChecker(params)
    text = OutputText(tok, params, checker)
    deltas = []
    for i in range(0, len(ids), split):
        check = checker.check_tokens(ids[i : i + split])
        deltas.append(text.push(ids[i : i + check.num_visible]))
        if checker.finished:
            break
    return deltas, text, checker


@pytest.mark.parametrize("split", [1, 3])
def test_deltas_join_to_the_text_without_special_tokens(tok, split):
    ids = tok.encode(TEXT)
    deltas, text, _ = _run(tok, SamplingParams(max_tokens=len(ids)), ids, split)
    assert "".join(deltas) == text.text == tok.decode(ids, skip_special_tokens=True)
    assert "<tool_call>" not in text.text and "ü.py" in text.text


def test_requested_special_tokens_stay_visible(tok):
    ids = tok.encode(TEXT)
    params = SamplingParams(max_tokens=len(ids), visible_special_tokens=TOOL_MARKUP)
    deltas, text, _ = _run(tok, params, ids, 2)
    assert "".join(deltas) == text.text == TEXT


@pytest.mark.parametrize("split", [1, 2, 5])
def test_a_stop_string_cuts_the_text_and_finishes(tok, split):
    ids = tok.encode(TEXT)
    params = SamplingParams(max_tokens=len(ids), stop=("read_",))
    deltas, text, checker = _run(tok, params, ids, split)
    assert "".join(deltas) == text.text == "Let me look. "
    assert checker.finish_reason == "stop" and checker.stop_reason == "read_"


def test_a_possible_stop_prefix_is_held_back_until_it_cannot_be_one(tok):
    ids = tok.encode("Let me look.")
    params = SamplingParams(max_tokens=len(ids), stop=("look!",))
    deltas, text, checker = _run(tok, params, ids, 1)
    assert not any(d.endswith("look") for d in deltas[:-1])  # "look" could have become "look!"
    assert "".join(deltas) == "Let me look." and checker.finish_reason == "length"


def _resumed(tok: Tokenizer, params: SamplingParams, ids: list[int], seam: int) -> str:
    """What a client gets when the stream stops after ``seam`` ids and resumes elsewhere: the first
    attempt's deltas, then the second's (a fresh OutputText told the first ``seam`` ids)."""
    first, _, checker = _run(tok, params, ids[:seam], 1)
    if checker.finished:
        return "".join(first)
    rest = SamplingParams(max_tokens=params.max_tokens - seam, stop=params.stop, num_resumed=seam)
    again = StopChecker(rest)
    text = OutputText(tok, rest, again)
    text.resume(ids[:seam])
    second = []
    for token in ids[seam:]:
        check = again.check_tokens([token])
        second.append(text.push([token][: check.num_visible]))
        if again.finished:
            break
    return "".join(first) + "".join(second)


@pytest.mark.parametrize("stop", [(), ("ü.py",), ("done 😀",), ("arg_value>ü",)])
def test_a_stream_resumed_at_any_token_reads_as_one_run(tok, stop):
    """A stop string or a character (ü, 😀: several byte tokens) across the seam: never a
    repeated, lost or broken piece of text."""
    ids = tok.encode(TEXT)
    params = SamplingParams(max_tokens=len(ids), stop=stop)
    whole = "".join(_run(tok, params, ids, 1)[0])
    assert whole != "" and all(_resumed(tok, params, ids, seam) == whole for seam in range(1, len(ids)))
