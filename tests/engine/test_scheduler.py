"""Scheduler on its own (no model): chunked prefill within the step budget, decode first, admission
by (priority, arrival), preemption of the latest arrival when blocks run out, removal."""

from __future__ import annotations

from glmserve.core.generation import SamplingParams
from glmserve.engine.kv_cache_manager import KVCacheManager
from glmserve.engine.request import Request
from glmserve.engine.scheduler import Scheduler, SchedulerConfig
from glmserve.kv.block_pool import BlockPool

BLOCK = 4


def _scheduler(num_blocks: int = 64, max_step_tokens: int = 16, max_num_seqs: int = 8,
               max_shared_prompt_tokens: int = 512) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BLOCK, root_hash=None)
    return Scheduler(SchedulerConfig(max_num_seqs, max_step_tokens, max_shared_prompt_tokens), kv)


def _req(rid: str, n: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(2, 2 + n)), SamplingParams(), priority=priority, arrival=arrival)


def _run(work) -> None:
    """What the engine does after the forward: computed tokens advance; a finished prompt samples."""
    for w in work:
        req = w.request
        req.num_computed += w.num_new
        if not req.in_prefill and (w.is_decode or req.num_computed == len(req.prompt_ids)):
            req.append_output([7])


def test_a_long_prompt_is_chunked_by_the_step_budget():
    s = _scheduler(max_step_tokens=16)
    req = _req("a", 40)
    s.add(req)
    sizes = []
    while req.in_prefill or not req.output_ids:
        work = s.schedule()
        sizes.append([w.num_new for w in work])
        _run(work)
    assert sizes == [[16], [16], [8]]
    assert [(w.num_new, w.is_decode) for w in s.schedule()] == [(1, True)]  # then one token a step


def test_decodes_go_first_and_prefills_take_what_is_left():
    s = _scheduler(max_step_tokens=10)
    s.add(_req("old", 3, arrival=1.0))
    _run(s.schedule())  # "old" is decoding now
    s.add(_req("new", 30, arrival=2.0))
    work = s.schedule()
    assert [(w.request.request_id, w.num_new, w.is_decode) for w in work] == [("old", 1, True), ("new", 9, False)]


def test_a_prompt_that_would_not_finish_waits_for_a_step_of_its_own():
    """Two 12-token prompts, budget 16: the first alone, then the second (not 12 + 4, then 8: the
    first prompt's token would wait for 4 of the second's); prompts that fit share a step."""
    s = _scheduler(max_step_tokens=16)
    for rid in ("a", "b"):
        s.add(_req(rid, 12))
    steps = []
    for _ in range(2):
        work = s.schedule()
        steps.append([(w.request.request_id, w.num_new) for w in work])
        _run(work)
    assert steps == [[("a", 12)], [("a", 1), ("b", 12)]]
    s = _scheduler(max_step_tokens=16)
    for rid in ("c", "d", "e"):
        s.add(_req(rid, 5))
    assert [(w.request.request_id, w.num_new) for w in s.schedule()] == [("c", 5), ("d", 5), ("e", 5)]


def test_prompts_share_a_step_up_to_the_shared_prompt_tokens():
    """Budget 32, sharing up to 10 prompt tokens: four 5-token prompts go two a step; a prompt over
    the limit still runs, alone; a resumed chunk counts against the limit like a new prompt."""
    s = _scheduler(max_step_tokens=32, max_shared_prompt_tokens=10)
    for rid in "abcd":
        s.add(_req(rid, 5))
    work = s.schedule()
    assert [w.request.request_id for w in work] == ["a", "b"]
    _run(work)
    assert [(w.request.request_id, w.num_new) for w in s.schedule()] == [("a", 1), ("b", 1), ("c", 5), ("d", 5)]
    s = _scheduler(max_step_tokens=32, max_shared_prompt_tokens=10)
    s.add(_req("long", 12))
    s.add(_req("short", 3))
    work = s.schedule()
    assert [(w.request.request_id, w.num_new) for w in work] == [("long", 12)]
    _run(work)
    assert [(w.request.request_id, w.num_new, w.is_decode) for w in s.schedule()] == [("long", 1, True), ("short", 3, False)]
    s = _scheduler(max_step_tokens=8, max_shared_prompt_tokens=10)
    s.add(_req("chunked", 12))
    _run(s.schedule())  # 8 of its 12 tokens
    s.add(_req("next", 4))
    assert [(w.request.request_id, w.num_new) for w in s.schedule()] == [("chunked", 4), ("next", 4)]
    s = _scheduler(max_step_tokens=8, max_shared_prompt_tokens=6)
    s.add(_req("chunked", 12))
    _run(s.schedule())
    s.add(_req("next", 4))
    assert [(w.request.request_id, w.num_new) for w in s.schedule()] == [("chunked", 4)]


def test_admission_follows_priority_then_arrival():
    s = _scheduler(max_step_tokens=3, max_num_seqs=1)
    for rid, prio, t in (("late", 0, 3.0), ("urgent", -1, 4.0), ("early", 0, 1.0)):
        s.add(_req(rid, 2, priority=prio, arrival=t))
    assert [w.request.request_id for w in s.schedule()] == ["urgent"]
    assert s.num_waiting == 2


def test_out_of_blocks_preempts_the_latest_arrival_which_is_recomputed():
    s = _scheduler(num_blocks=6, max_step_tokens=64)
    first, second = _req("first", 8, arrival=1.0), _req("second", 12, arrival=2.0)
    s.add(first), s.add(second)
    _run(s.schedule())  # 2 + 3 of the 6 blocks; both sampled a token
    work = s.schedule()  # both need one more block, one is left: "second" (the later) is preempted
    assert s.num_preemptions == 1 and second.num_preemptions == 1
    # ... and, its blocks free again, restarts at once: prompt + output minus the pending token.
    assert [(w.request.request_id, w.num_new, w.is_decode) for w in work] == [("first", 1, True), ("second", 12, False)]
    assert second.num_computed == 0 and second.output_ids == [7] and len(second.block_ids) == 3


def test_remove_frees_the_blocks_unless_they_are_kept():
    s = _scheduler(max_step_tokens=32)
    a, b = _req("a", 9), _req("b", 9)
    s.add(a), s.add(b)
    s.schedule()
    pool = s.kv.pool
    used = pool.num_used
    s.remove(a)
    assert pool.num_used == used - 3 and a not in s.running
    s.remove(b, free_blocks=False)  # a prefill-only request whose KV is still to be shipped
    assert pool.num_used == used - 3 and b.block_ids
