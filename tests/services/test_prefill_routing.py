"""PrefillRouting and SessionAffinity: exact choices for cache hits, load, host credit, sessions,
the herding guard and the fallback (pure logic, no I/O)."""

from __future__ import annotations

import pytest

from glmserve.services.router.prefill_routing import PrefillCandidate, PrefillRouting, RoutingConfig
from glmserve.services.router.session_affinity import SessionAffinity

BS = 16


def cand(address: str, load: int = 0, device: int = 0, host: int = 0, queued: int = 0,
         inflight: int | None = None, free: int = 10) -> PrefillCandidate:
    return PrefillCandidate(address, load, load if inflight is None else inflight, queued, device, host, free)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_worker_holding_the_prefix_wins_with_exact_expected_hits() -> None:
    r = PrefillRouting()
    d = r.choose([cand("a"), cand("b", device=6)], 100, BS)
    assert (d.address, d.reason) == ("b", "cache_hit")
    # 100 tokens: at most floor(99 / 16) = 6 blocks reusable = 96 tokens; the rest is computed.
    assert (d.device_hit_tokens, d.host_hit_tokens, d.compute_tokens) == (96, 0, 4)


def test_hits_never_exceed_the_reusable_blocks() -> None:
    d = PrefillRouting().choose([cand("a", device=7)], 7 * BS, BS)  # a full last block is recomputed
    assert (d.device_hit_tokens, d.compute_tokens) == (6 * BS, BS)


def test_without_hits_the_least_queued_worker_wins_and_ties_go_round_robin() -> None:
    r = PrefillRouting()
    assert r.choose([cand("a", 1, queued=300), cand("b", 1, queued=100)], 50, BS).address == "b"
    picks = [r.choose([cand("a"), cand("b"), cand("c")], 50, BS) for _ in range(4)]
    assert [p.address for p in picks] == ["a", "b", "c", "a"]
    assert {p.reason for p in picks} == {"load"}


def test_queued_work_outweighs_a_small_hit() -> None:
    r = PrefillRouting(RoutingConfig(shared_prefix_fraction=0.0))
    # b holds 2 blocks (32 tokens) but has 200 tokens queued: a computes 200 now, b 168 + 200.
    assert r.choose([cand("a"), cand("b", 1, device=2, queued=200)], 200, BS).address == "a"
    # with only 20 tokens queued, b is cheaper (168 + 20 < 200)
    assert r.choose([cand("a"), cand("b", 1, device=2, queued=20)], 200, BS).address == "b"


def test_requests_reported_by_other_routers_count_as_unknown_tokens() -> None:
    r = PrefillRouting(RoutingConfig(unknown_request_tokens=1000, shared_prefix_fraction=0.0))
    # b: 3 requests reported, none of them ours -> 3000 tokens of unknown work
    d = r.choose([cand("a"), cand("b", 3, device=6, inflight=0)], 100, BS)
    assert d.address == "a"


def test_host_hits_get_partial_credit() -> None:
    r = PrefillRouting(RoutingConfig(host_credit=0.5))
    # a: 4 device blocks (64 tokens); b: 6 host blocks, 96 tokens at half credit = 48: a wins.
    d = r.choose([cand("a", device=4), cand("b", host=6)], 100, BS)
    assert (d.address, d.device_hit_tokens) == ("a", 64)
    full = PrefillRouting(RoutingConfig(host_credit=1.0)).choose([cand("a", device=4), cand("b", host=6)], 100, BS)
    assert (full.address, full.host_hit_tokens, full.device_hit_tokens) == ("b", 96, 0)
    # a host run beyond the device run is credited only for the blocks past the device ones
    both = r.choose([cand("a", device=2, host=5)], 100, BS)
    assert (both.device_hit_tokens, both.host_hit_tokens, both.compute_tokens) == (32, 48, 20)


def test_herding_guard_spreads_a_shared_system_prompt() -> None:
    r = PrefillRouting(RoutingConfig(shared_prefix_fraction=0.5))
    # Only "a" holds the shared 2-block system prompt of a 400-token request and is busier.
    d = r.choose([cand("a", 1, device=2, queued=10), cand("b")], 400, BS)
    assert (d.address, d.reason) == ("b", "herding_guard")
    # A hit covering most of the prompt (a session's history) is worth a busier worker.
    d = r.choose([cand("a", 1, device=20, queued=10), cand("b")], 400, BS)
    assert (d.address, d.reason) == ("a", "cache_hit")


def test_a_hit_buys_at_most_max_imbalance_requests_of_load() -> None:
    r = PrefillRouting(RoutingConfig(max_imbalance=2, unknown_request_tokens=0))
    assert r.choose([cand("a", 2, device=20), cand("b", 0)], 400, BS).reason == "cache_hit"
    d = r.choose([cand("a", 3, device=20), cand("b", 0)], 400, BS)
    assert (d.address, d.reason) == ("b", "herding_guard")


def test_sessions_stay_on_their_worker_until_it_is_overloaded_or_the_ttl_passes() -> None:
    clock = Clock()
    r = PrefillRouting(RoutingConfig(max_imbalance=1), SessionAffinity(ttl_s=60, clock=clock))
    first = r.choose([cand("a"), cand("b")], 100, BS, session_id="s1")
    home = first.address
    other = "b" if home == "a" else "a"
    assert first.reason == "load"
    loads = {home: 1, other: 0}  # home is a little busier and holds nothing known: still home
    d = r.choose([cand(x, loads[x]) for x in ("a", "b")], 100, BS, session_id="s1")
    assert (d.address, d.reason) == (home, "session")
    loads = {home: 2, other: 0}  # overloaded: the session moves, and stays on its new worker
    d = r.choose([cand(x, loads[x]) for x in ("a", "b")], 100, BS, session_id="s1")
    assert d.address == other and d.reason != "session"
    assert r.choose([cand("a"), cand("b")], 100, BS, session_id="s1").address == other
    clock.now = 61  # expired: chosen by cost again (round robin between equals)
    assert r.choose([cand("a"), cand("b")], 100, BS, session_id="s1").reason == "load"
    # a worker with a full pool is no session home
    assert r.choose([cand("a", free=0), cand("b", free=0)], 100, BS, session_id="s2").reason == "load"
    r.sessions.record("s2", "a")
    assert r.choose([cand("a", free=0), cand("b")], 100, BS, session_id="s2").reason != "session"


def test_fallback_when_the_index_could_not_be_asked() -> None:
    d = PrefillRouting().choose([cand("a", 1), cand("b")], 100, BS, index_known=False)
    assert (d.address, d.reason) == ("b", "fallback")
    assert PrefillRouting().choose([], 100, BS) is None


def test_session_table_is_bounded_and_forgets_workers() -> None:
    clock = Clock()
    s = SessionAffinity(ttl_s=10, max_sessions=2, clock=clock)
    s.record("x", "a")
    s.record("y", "b")
    s.record("z", "a")
    assert (s.get("x"), s.get("y"), s.get("z"), len(s)) == (None, "b", "a", 2)
    s.forget_worker("a")
    assert s.get("z") is None and s.get("y") == "b"
    clock.now = 10
    assert s.get("y") is None


@pytest.mark.parametrize("field,value", [("host_credit", 1.5), ("max_imbalance", -1),
                                         ("shared_prefix_fraction", -0.1), ("session_ttl_s", 0),
                                         ("policy", "random")])
def test_bad_config_names_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**{field: value})


def test_least_loaded_ignores_cache_hits_and_sessions() -> None:
    r = PrefillRouting(RoutingConfig(policy="least_loaded"))
    d = r.choose([cand("a", 1, device=6), cand("b")], 100, BS, session_id="s")
    assert (d.address, d.reason, d.device_hit_tokens, d.compute_tokens) == ("b", "load", 0, 100)
    d = r.choose([cand("a"), cand("b", 2)], 100, BS, session_id="s")  # no affinity to b
    assert (d.address, d.reason) == ("a", "load")


def test_round_robin_takes_workers_in_turn_whatever_their_load_or_hits() -> None:
    r = PrefillRouting(RoutingConfig(policy="round_robin"))
    picks = [r.choose([cand("a", 5), cand("b", device=6)], 100, BS, session_id="s") for _ in range(4)]
    assert [(d.address, d.reason) for d in picks] == [("a", "round_robin"), ("b", "round_robin")] * 2


def test_local_view_matches_leading_runs_and_is_bounded() -> None:
    from glmserve.kv.block_index import PrefixMatch
    from glmserve.services.router.local_prefix_view import LocalPrefixView

    h = [bytes([i + 1]) * 16 for i in range(6)]
    view = LocalPrefixView(max_blocks_per_worker=4)
    view.stored("w1", h[:3])
    view.stored("w2", h[:2])
    assert view.match(h[:4]) == {"w1": PrefixMatch(3, 0), "w2": PrefixMatch(2, 0)}
    view.stored("w1", h[3:6])  # 6 blocks > 4: the oldest (the prompt's head) leave first
    assert view.match(h) == {"w2": PrefixMatch(2, 0)} and view.num_blocks() == 6
    view.remove_worker("w2")
    assert view.match(h) == {}
