"""The tiers benchmark runs (``cluster/bench/tiers.py``) on a small ``slot_pressure``: the
workload's shape, and the in-process cluster with tiers off and on for our router and
Ray's rule -- counts only (every figure here is a count or a count of steps; seconds are
reported, not checked)."""

from __future__ import annotations

import pytest

from cluster.bench import tiers as T
from cluster.bench.workloads import load_workload

SMALL = {
    "num_sessions": 6,
    "num_turns": 3,
    "num_toolsets": 2,
    "system_len": 48,
    "task_len": 16,
    "tool_output_len": 24,
    "instruction_len": 4,
    "output_len": 4,
}
# Two replicas of 4 slots each (2 running): the 6 sessions' checkpoints do not fit on device.
SETTINGS = T.ClusterSettings(
    num_replicas=2,
    kv_tokens=2048,
    slot_kv_tokens=512,
    host_factor=4,
    max_running=2,
    page_size=8,
    track_interval=16,
    chunk=128,
    arrival_steps=1,
    think_steps=2,
)


def test_slot_pressure_contexts_grow_by_tool_outputs_every_turn():
    w = load_workload("slot_pressure", SMALL)
    assert len(w.sessions) == 6 and {s.group for s in w.sessions} == {"toolset-0", "toolset-1"}
    for s in w.sessions:
        assert len(s.shared_ids) == 48 and len(s.turns) == 3 and len(s.turns[0].user_ids) == 16
        # tool output +- 50 %, instruction
        assert all(12 + 4 <= len(t.user_ids) <= 36 + 4 for t in s.turns[1:])


@pytest.fixture(scope="module")
def results(tiny_qwen_dir):
    sessions = load_workload("slot_pressure", SMALL).sessions
    return [
        T.run_one(tiny_qwen_dir, sessions, router, on, SETTINGS)
        for router in ("hybrid_prefix", "ray_prefix")
        for on in (False, True)
    ]


def test_every_turn_runs_and_the_tiers_serve_more_of_the_prompts(results):
    by = {(r.router, r.tiers): r for r in results}
    for r in results:
        assert r.num_requests == 18 and 0 <= r.cached_tokens < r.prompt_tokens
        assert r.computed_fraction == pytest.approx(1 - r.cached_fraction, abs=1e-3)
    on, off = by[("hybrid_prefix", True)], by[("hybrid_prefix", False)]
    assert on.cached_tokens > off.cached_tokens, (on, off)
    assert on.hits_by_tier.get("host", 0) + on.hits_by_tier.get("store", 0) > 0, on.hits_by_tier
    assert set(off.hits_by_tier) <= {"device"}, off
    assert on.store.get("hybridserve_store_objects", 0) > 0, on.store
    g = T.goals(results)
    assert g["computed_prefill_tiers_over_device"] == round(on.computed_fraction / off.computed_fraction, 3)
    assert g["cached_vs_ray"] is not None and "hybrid_prefix" in T.format_table(results)


def test_ttft_split_matches_the_runs_ttft(results):
    """Queue wait + prefill = TTFT (steps, modelled seconds), over every request, and the
    steps agree with the run's own mean TTFT; a modelled step costs at least ``a``."""
    for r in results:
        sp = r.split
        assert sp["requests"] == r.num_requests
        assert sp["ttft_steps"] == pytest.approx(r.mean_ttft_steps, abs=0.01)
        assert sp["queue_steps"] + sp["prefill_steps"] == pytest.approx(sp["ttft_steps"], abs=1e-3)
        assert sp["queue_model_s"] + sp["prefill_model_s"] == pytest.approx(sp["ttft_model_s"], abs=1e-3)
        assert sp["prefill_steps"] >= 1
        assert sp["prefill_model_s"] >= T.StepCost().a * sp["prefill_steps"] * 0.99


def test_the_store_is_modelled_at_qwen3_next_proportions():
    """``ClusterSettings.store_model``: each entry is charged its slot at ``slot_kv_tokens``
    KV tokens, the budget is ``store_factor`` replica device budgets at that weight, and the
    fixed cost model fetches a default-sized entry (a slot and a 400-token path) only when
    it saves more than ~200 tokens of prefill."""
    from workers.tiers.cost import FetchCost

    s = T.ClusterSettings()
    budget, extra, fetch = s.store_model(token_bytes=1024, slot_bytes=16896)
    assert extra == 3072 * 1024 - 16896 and not fetch.measure
    assert budget == int(4.0 * (24576 * 1024 + s.num_slots * 3072 * 1024))
    entry = 16896 + extra + 400 * 1024

    def fetches(tokens: int) -> bool:
        return FetchCost(
            entry, tokens, fetch.bandwidth_bytes_per_s, fetch.prefill_tokens_per_s, fetch.latency_s, fetch.margin
        ).should_fetch

    assert not fetches(150) and fetches(250)
