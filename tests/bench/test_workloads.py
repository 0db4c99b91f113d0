"""Workloads: every shipped YAML loads, generation is deterministic, shapes are right."""

from __future__ import annotations

import pytest

from cluster.bench.workloads import (
    CachePressureSpec,
    MultiTurnSpec,
    Renderer,
    SharedPrefixSpec,
    build,
    load_spec,
    load_workload,
    workload_names,
)

NAMES = workload_names()
SIZED = {"cache_pressure": {"cluster_cache_tokens": 4096}}


def test_the_five_workloads_ship():
    assert {"random", "shared_prefix", "prefix_repetition", "cache_pressure", "multi_turn"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_sessions_other_seed_differs(name):
    extra = SIZED.get(name, {})
    a = load_workload(name, extra)
    assert a.sessions == load_workload(name, extra).sessions and a.warmup == load_workload(name, extra).warmup
    b = load_workload(name, {**extra, "seed": 1})
    assert [s.first_prompt_ids() for s in a.sessions] != [s.first_prompt_ids() for s in b.sessions]
    spec = load_spec(name, extra)
    for s in a.sessions + a.warmup:
        for t in s.turns:
            assert all(spec.token_low <= x < spec.token_high for x in s.shared_ids + t.user_ids)


def test_random_lengths_stay_in_range():
    w = load_workload("random", {"num_prompts": 300, "input_len": 100, "range_ratio": 0.2, "prefix_len": 5})
    lens = [len(s.turns[0].user_ids) for s in w.sessions]
    assert len(w.sessions) == 300 and min(lens) >= 80 and max(lens) <= 120 and len(set(lens)) > 10
    assert len({s.shared_ids for s in w.sessions}) == 1 and len(w.sessions[0].shared_ids) == 5


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    w = build(SharedPrefixSpec(num_groups=4, prompts_per_group=3, system_len=20, question_len=5))
    assert len(w.sessions) == 12
    by_group: dict[str, set] = {}
    for s in w.sessions:
        by_group.setdefault(s.group, set()).add(s.shared_ids)
        assert len(s.shared_ids) == 20 and len(s.turns[0].user_ids) == 5
    assert len(by_group) == 4 and all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == 4
    grouped = build(SharedPrefixSpec(num_groups=4, prompts_per_group=3, order="grouped"))
    assert [s.group for s in grouped.sessions[:3]] == ["group-0"] * 3


def test_prefix_repetition_cycles_prefixes():
    w = load_workload("prefix_repetition", {"num_prompts": 20, "num_prefixes": 4})
    assert len(w.sessions) == 20 and len({s.shared_ids for s in w.sessions}) == 4
    assert len({s.turns[0].user_ids for s in w.sessions}) == 20


def test_cache_pressure_sizes_tenants_from_the_cluster_cache():
    spec = CachePressureSpec(cluster_cache_tokens=10_000, context_len=500, queries_per_tenant=3, warmup_per_tenant=1)
    assert spec.tenants() == 14  # 0.7 * 10000 / 500
    w = build(spec)
    assert w.info["num_tenants"] == 14 and w.info["context_fraction_of_cluster_cache"] == 0.7
    assert len(w.sessions) == 42 and len(w.warmup) == 14
    assert sorted(s.group for s in w.warmup) == sorted(f"tenant-{t}" for t in range(14))
    assert {s.session_id for s in w.sessions}.isdisjoint({s.session_id for s in w.warmup})
    with pytest.raises(ValueError, match="cluster_cache_tokens"):
        CachePressureSpec().tenants()


def test_multi_turn_sessions_have_their_turns():
    w = build(
        MultiTurnSpec(
            num_sessions=3, num_turns=4, system_len=8, first_len=6, user_len=2, api="chat", prompt_format="text"
        )
    )
    assert len(w.sessions) == 3 and w.num_requests == 12
    s = w.sessions[0]
    assert len(s.shared_ids) == 8 and [len(t.user_ids) for t in s.turns] == [6, 2, 2, 2]


def test_bad_specs_are_refused_with_the_key_named():
    with pytest.raises(ValueError, match="typo"):
        load_spec("random", {"typo": 1})
    with pytest.raises(ValueError, match="prompt_format"):
        load_spec("multi_turn", {"prompt_format": "ids"})
    with pytest.raises(ValueError, match="no workload"):
        load_spec("nope")


def test_word_renderer_is_deterministic():
    r = Renderer()
    assert r.text([1, 2, 3]) == r.text([1, 2, 3]) and r.text([]) == ""
    assert r.text([1, 2]) + r.text([3]) == r.text([1, 2, 3])
