"""The routing decision and the router actor's state, with fake replica stats (no Ray)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from cluster.routing.router_actor import RouterIndexState
from cluster.routing.routing_policy import (
    LoadPenalty,
    RecentPlacements,
    ReplicaView,
    RouterSettings,
    RouterState,
    decide,
    is_imbalanced,
    load_cost,
    max_usable_depth,
    views_from,
)
from configs.schema import load_config
from workers.cache.records import CheckpointInserted

S = RouterSettings(load_penalty_tokens=16, imbalance_abs=8, imbalance_rel=1.5, min_match_tokens=16)


def test_prefix_prefers_the_deepest_checkpoint_then_the_rest_by_score():
    views = [ReplicaView("a", 0, 0), ReplicaView("b", 64, 1), ReplicaView("c", 32, 0)]
    d = decide(views, S, random.Random(0))
    assert d.reason == "prefix" and d.depth == 64
    assert d.ranks == [["b"], ["c", "a"]]


def test_load_penalty_trades_cached_tokens_against_queued_requests():
    # b holds 64 more tokens but has 5 more requests queued: 64 - 16*5 < 0 - 0
    views = [ReplicaView("a", 0, 0), ReplicaView("b", 64, 5)]
    assert decide(views, S).ranks[0] == ["a"]
    views = [ReplicaView("a", 0, 0), ReplicaView("b", 64, 3)]
    assert decide(views, S).ranks[0] == ["b"]


def test_imbalance_gate_is_per_request_against_the_preferred_replica():
    cheap = RouterSettings(load_penalty_tokens=0, imbalance_abs=8, imbalance_rel=1.5, min_match_tokens=16)
    hot = [ReplicaView("a", 512, 20), ReplicaView("b", 0, 2), ReplicaView("c", 0, 30)]
    d = decide(hot, cheap)
    assert d.reason == "imbalanced" and d.ranks[0] == ["b"]
    # c is as hot, but it is not the preferred replica of this request: no gate
    calm = [ReplicaView("a", 512, 3), ReplicaView("b", 0, 2), ReplicaView("c", 0, 30)]
    assert decide(calm, cheap).reason == "prefix"
    assert is_imbalanced(20, 2, cheap) and not is_imbalanced(10, 2, cheap)  # abs: 8 < 8 fails
    assert not is_imbalanced(40, 30, cheap)  # abs ok, rel 40 < 45 fails


def test_cold_prompts_go_to_the_least_loaded_then_the_least_cached():
    views = [ReplicaView("a", 8, 1, 10), ReplicaView("b", 0, 0, 50), ReplicaView("c", 0, 0, 5)]
    d = decide(views, S)  # 8 < min_match_tokens: cold
    assert d.reason == "cold" and d.ranks == [["c"], ["b", "a"]]


def test_a_burst_of_cold_prompts_spreads_before_loads_and_the_index_catch_up():
    """Loads and checkpoint counts are stale within a burst (all 0 here): the router's own
    recent cold placements count as load, so eight new prefixes land two per replica."""
    recent, rng = RecentPlacements(window_s=2.0), random.Random(0)
    state = RouterState(RouterSettings(), recent)
    placed = []
    for _ in range(8):
        views = views_from(["a", "b", "c", "d"], {}, {}, {}, recent.counts(now=10.0))
        placed.append(state.decide(views, 64, 10.0, rng).ranks[0][0])
    assert Counter(placed) == {"a": 2, "b": 2, "c": 2, "d": 2}
    assert recent.counts(now=12.5) == {}  # out of the window: forgotten
    views = views_from(["a", "b"], {"a": 40}, {}, {}, {"a": 5})
    assert state.decide(views, 64, 13.0, rng).reason == "prefix"
    assert recent.counts(now=13.0) == {}  # only cold placements count


def test_ties_are_broken_at_random():
    views = [ReplicaView(r, 0, 0) for r in "abcd"]
    firsts = Counter(decide(views, S, random.Random(i)).ranks[0][0] for i in range(400))
    assert set(firsts) == set("abcd") and min(firsts.values()) > 60


def test_views_treat_unknown_load_as_idle_and_cap_depth():
    views = views_from(["a", "b"], {"a": 10}, {"a": None, "b": 3}, {"b": 7})
    assert views == [ReplicaView("a", 10, 0, 0), ReplicaView("b", 0, 3, 7)]
    assert max_usable_depth(10) == 9 and max_usable_depth(0) == 0


def test_bad_settings_and_no_candidates_raise():
    with pytest.raises(ValueError, match=r"router.imbalance_rel.*0.5"):
        load_config(overrides={"router.imbalance_rel": 0.5})
    with pytest.raises(ValueError, match=r"router.min_match_tokens.*0"):
        load_config(overrides={"router.min_match_tokens": 0})
    with pytest.raises(ValueError, match="no candidate"):
        decide([], S)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_router_state_matches_and_forgets_silent_replicas():
    clock = FakeClock()
    state = RouterIndexState(forget_after_s=10, clock=clock)
    tokens = tuple(range(1, 9))
    state.apply("r1", [CheckpointInserted(8, b"h", tokens)])
    state.apply("r2", [])  # heartbeat only
    report = state.match(list(tokens) + [99], ["r1", "r2", "r3"], max_depth=8)
    assert report.depths == {"r1": 8, "r2": 0, "r3": 0}
    assert report.sizes == {"r1": 1, "r2": 0, "r3": 0}
    clock.now = 8
    state.apply("r2", [])
    clock.now = 15  # r1 silent for 15 s: forgotten
    assert state.replicas() == ["r2"]
    assert state.match(list(tokens) + [99], ["r1"], 8).depths == {"r1": 0}
    state.forget(["r2"])
    assert state.summary()["replicas"] == []


def test_the_load_penalty_learns_the_prefill_routed_requests_compute():
    learnt = LoadPenalty(RouterSettings(load_penalty_tokens=16), alpha=0.5)
    assert learnt.tokens == 16  # nothing seen: the floor
    learnt.observe(400, 100)  # computes 300
    assert learnt.tokens == 300
    learnt.observe(400, 300)  # computes 100: mean 200
    assert learnt.tokens == 200
    for _ in range(20):
        learnt.observe(400, 399)  # all cached: down to the floor
    assert learnt.tokens == 16
    fixed = LoadPenalty(RouterSettings(load_penalty_tokens=16, load_penalty_auto=False), alpha=0.5)
    fixed.observe(400, 100)
    assert fixed.tokens == 16


def test_a_learnt_penalty_spreads_what_a_fixed_one_piles_on_one_replica():
    """b holds a 192-token system prompt and 3 ongoing requests. With 16 tokens per request
    it wins (192 - 48 > 0); once the router has seen requests compute ~300 tokens each, a
    queued request there costs more than the prefix saves, and the idle replica wins."""
    views = [ReplicaView("a", 0, 0), ReplicaView("b", 192, 3)]
    fixed = RouterState(RouterSettings(load_penalty_auto=False))
    learnt = RouterState(RouterSettings())
    for _ in range(200):
        fixed.penalty.observe(500, 200)
        learnt.penalty.observe(500, 200)
    assert fixed.decide(views, 500, 0.0, random.Random(0)).ranks[0] == ["b"]
    assert learnt.decide(views, 500, 0.0, random.Random(0)).ranks[0] == ["a"]


def test_below_its_capacity_a_replica_costs_a_decode_row_per_request_beyond_it_a_wait():
    """Capacity 3: a replica running 2 has room, so a newcomer only shares its steps (16
    tokens a request); at 3 and beyond each request is a wait for a slot (the learnt 300)."""
    s = RouterSettings(load_penalty_tokens=16, replica_capacity=3)
    assert [load_cost(n, s, 300.0) for n in range(5)] == [0, 16, 32, 332, 632]
    assert load_cost(4, RouterSettings(load_penalty_tokens=16), 300.0) == 1200  # capacity unknown
    views = [ReplicaView("a", 0, 0), ReplicaView("b", 192, 2)]
    assert decide(views, s, random.Random(0), penalty=300.0).ranks[0] == ["b"]  # room: the prefix wins
    views = [ReplicaView("a", 0, 0), ReplicaView("b", 192, 3)]
    assert decide(views, s, random.Random(0), penalty=300.0).ranks[0] == ["a"]  # full: the idle one
