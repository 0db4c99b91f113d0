"""The routing simulator on a small case: the modelled replica cache, the real index and
routers behind it, determinism, and the ordering every run should show."""

from __future__ import annotations

import random

import pytest

from cluster.bench.routing_sim import SimReplica, SimSettings, run_grid, scaled_workload, simulate
from cluster.bench.sim_routers import HybridPrefixSim, make_router
from workers.cache.records import CheckpointEvicted, CheckpointInserted

S = SimSettings(num_replicas=4, cache_tokens=64, page_size=4, track_interval=8)


def test_replica_checkpoints_sit_where_the_engine_writes_them():
    r = SimReplica(S)
    a = list(range(100, 118))  # 18 tokens
    assert r.match(a) == (0, 0)
    assert r.prefill_depths(a, 0, 0) == [16]  # ((18 - 1) // 4) * 4
    assert [type(e) for e in r.insert(a, 16)] == [CheckpointInserted]
    b = a[:10] + [7, 7, 7, 7, 7, 7]  # shares 10 tokens = 2 full pages
    assert r.match(b) == (0, 8)  # KV to 8, no checkpoint on b's path
    assert r.prefill_depths(b, 0, 8) == [8, 12, 16]  # branching point, last page, grid-aligned end
    r.insert(b, 8)
    assert r.match(a + [1]) == (16, 16) and r.match(b)[0] == 8
    assert r.match(a[:16])[0] == 8  # the one at 16 would need 0 tokens computed
    assert r.decode_depth(18, 30) == 24 and r.decode_depth(18, 20) == 0
    chunked = SimReplica(SimSettings(page_size=4, track_interval=8, chunk_size=8))
    assert chunked.prefill_depths(list(range(30)), 0, 0) == [8, 16, 24, 28]  # chunk ends on the grid
    assert r.prefill_depths(list(range(500, 522)), 0, 0) == [16, 20]  # grid point below the last page
    assert r.prefill_depths(list(range(500, 522)), 16, 16) == [20]


def test_replica_evicts_least_recent_checkpoints_to_fit_its_pages():
    r = SimReplica(S)  # 64 tokens = 16 pages
    events = []
    for i in range(5):
        events += r.insert([i * 1000 + t for t in range(16)], 16)  # 4 pages each
    evicted = [e for e in events if isinstance(e, CheckpointEvicted)]
    assert len(evicted) == 1 and evicted[0].token_ids[0] == 0
    assert r.match(list(range(1000, 1017)))[0] == 16


def test_hybrid_router_sees_the_replicas_events():
    router = HybridPrefixSim(["a", "b"], random.Random(0))
    path = tuple(range(40))
    router.on_events("b", [CheckpointInserted(40, b"", path)])
    assert router.choose(list(path) + [1, 2], {"a": 0, "b": 0}, 0.0) == "b"
    router.on_events("b", [CheckpointEvicted(40, b"", path)])
    assert router.index.num_checkpoints("b") == 0
    with pytest.raises(ValueError):
        make_router("nope", ["a"], random.Random(0))


def test_small_cache_pressure_run_is_deterministic_and_ordered():
    s = SimSettings(num_replicas=4, cache_tokens=2048)
    w = scaled_workload("cache_pressure", s, {"queries_per_tenant": 3})
    results = {r: simulate(w, r, s) for r in ("hybrid_prefix", "hybrid_prefix_kv", "ray_prefix", "round_robin")}
    again = simulate(w, "hybrid_prefix", s)
    assert again == results["hybrid_prefix"]
    n = len(w.sessions)
    assert all(r.num_requests == n and sum(r.requests_per_replica.values()) == n for r in results.values())
    rr = results["round_robin"].cached_fraction
    assert results["ray_prefix"].cached_fraction > 2 * rr
    assert results["hybrid_prefix_kv"].cached_fraction > 2 * rr
    assert results["hybrid_prefix_kv"].cached_fraction >= results["hybrid_prefix"].cached_fraction


def test_multi_turn_reuses_earlier_turns_under_affinity():
    res = run_grid(["multi_turn"], [4], ("hybrid_prefix", "round_robin"), SimSettings(sessions_per_replica=2))
    by = {r.router: r for r in res}
    assert by["hybrid_prefix"].num_requests == 4 * 2 * 4  # replicas x sessions x turns
    assert by["hybrid_prefix"].cached_fraction > by["round_robin"].cached_fraction
