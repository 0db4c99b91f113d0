"""The computed-token breakdown of ``cluster/bench/tiers_explain.py``: its waterfall (pure),
and, on a small in-process run, that it accounts for every prompt token."""

from __future__ import annotations

import pytest

from cluster.bench import tiers as T
from cluster.bench.tiers_explain import CAUSES, Explanation, Snapshot, split
from cluster.bench.workloads import load_workload
from tests.bench.test_tiers_bench import SETTINGS, SMALL


def snap(**kw) -> Snapshot:
    base = dict(
        prompt=400,
        sent=300,
        seen=300,
        oracle=288,
        ever=256,
        alive=192,
        reachable=128,
        system_len=100,
        previous_prompt=270,
        page=16,
    )
    return Snapshot(**{**base, **kw})


def test_every_gap_of_the_waterfall_has_its_cause():
    out = split(snap(), cached=64)
    assert out == {
        "first_system": 0,
        "new_suffix": 100,
        "in_flight": 0,
        "page": 12,
        "previous_output": 18,
        "placement": 14,
        "dropped": 64,
        "elsewhere": 64,
        "refused": 0,
        "lost_in_queue": 64,
    }
    assert sum(out.values()) == 400 - 64
    refused = split(snap(fetch="recomputed"), cached=64)
    assert refused["refused"] == 64 and refused["lost_in_queue"] == 0


def test_first_sight_and_in_flight():
    out = split(snap(sent=60, seen=0, oracle=0, ever=0, alive=0, reachable=0, previous_prompt=0), cached=0)
    assert out["first_system"] == 40 and out["new_suffix"] == 300 and out["in_flight"] == 60


def test_a_hit_deeper_than_the_snapshot_clamps_every_level():
    """A checkpoint published after routing (cached > reachable): no negative gaps."""
    out = split(snap(reachable=0, alive=0), cached=256)
    assert min(out.values()) >= 0 and sum(out.values()) == 400 - 256 and out["dropped"] == 0


def test_explanation_sums_and_oracles():
    ex = Explanation()
    ex.add(snap(), 64)
    ex.add(snap(sent=0, seen=0, oracle=0, ever=0, alive=0, reachable=0, previous_prompt=0), 0)
    d = ex.as_dict()
    assert d["prompt_tokens"] == 800 and d["cached_tokens"] == 64
    assert sum(d["computed_by_cause"].values()) == 800 - 64 and set(d["computed_by_cause"]) == set(CAUSES)
    assert d["oracle_cached_fraction"] == d["oracle_computed_fraction"] == round(288 / 800, 4)


@pytest.mark.parametrize("tiers", [False, True])
def test_a_run_accounts_for_every_prompt_token(tiny_qwen_dir, tiers):
    w = load_workload("slot_pressure", SMALL)
    r = T.run_one(tiny_qwen_dir, w.sessions, "hybrid_prefix", tiers, SETTINGS)
    ex = r.explain
    assert (ex["prompt_tokens"], ex["cached_tokens"]) == (r.prompt_tokens, r.cached_tokens)
    assert sum(ex["computed_by_cause"].values()) == r.prompt_tokens - r.cached_tokens
    # Each of the two tool sets' system prompts is computed once, on its first sight.
    assert ex["computed_by_cause"]["first_system"] == 2 * SMALL["system_len"]
    assert r.cached_fraction <= ex["oracle_computed_fraction"] <= ex["oracle_cached_fraction"]
    assert "first_system" in T.format_explanation([(r.router, r.tiers, ex)])
