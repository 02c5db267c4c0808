"""Request bookkeeping: prompt + output is one list grown in place, never rebuilt per step."""

import pytest

from glmserve.core.generation import SamplingParams
from glmserve.engine.request import Request


def test_token_ids_grow_in_place():
    req = Request("r", [1, 2, 3], SamplingParams())
    ids = req.token_ids
    req.append_output([4, 5])
    req.append_output([6])
    assert req.token_ids is ids and ids == [1, 2, 3, 4, 5, 6]
    assert req.output_ids == [4, 5, 6] and req.prompt_ids == [1, 2, 3] and req.num_tokens == 6


def test_the_prompt_is_not_aliased():
    prompt = [1, 2]
    req = Request("r", prompt, SamplingParams())
    req.append_output([3])
    assert prompt == [1, 2] and req.prompt_ids == [1, 2]


def test_in_prefill_until_only_the_pending_token_is_left():
    req = Request("r", [1, 2, 3], SamplingParams())
    assert req.in_prefill
    req.num_computed = 3
    req.append_output([9])  # sampled, not yet run through the model
    assert not req.in_prefill


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="^prompt_ids:"):
        Request("r", [], SamplingParams())
