"""The suite's config, goals and report (no measurements), and ``hybridserve bench`` run
mode end to end against the fake server."""

from __future__ import annotations

import json

import pytest

from cluster.bench.suite import HEADLINE, build_summary, format_table
from cluster.bench.suite_config import GOALS, SECTIONS, load_suite_config
from cluster.cli import main
from tests.bench.fake_openai import FakeOpenAI


def test_shipped_suite_config_loads_and_overrides_apply():
    cfg = load_suite_config(overrides={"repeats": 1, "routing": {"num_replicas": 2}})
    assert cfg.repeats == 1 and cfg.routing.num_replicas == 2 and cfg.routing.workload == "cache_pressure"
    assert set(cfg.sections) == set(SECTIONS) and cfg.spec.prompts
    with pytest.raises(ValueError, match="typo"):
        load_suite_config(overrides={"typo": 1})
    with pytest.raises(ValueError, match="sections"):
        load_suite_config(overrides={"sections": ["nope"]})


def test_every_headline_key_has_a_goal():
    assert set(HEADLINE) == set(GOALS)
    assert GOALS["serving_efficiency"].met(0.9) and not GOALS["serving_efficiency"].met(0.8)
    assert GOALS["prefix_cache_ttft_ratio"].met(0.35) and GOALS["overlap_speedup"].met(None) is None


def test_summary_and_table_from_section_results():
    details = {
        "overlap": {"overlap_speedup": 1.1, "tok_s_on": 11.0, "tok_s_off": 10.0},
        "spec": {"error": "RuntimeError: boom"},
    }
    s = build_summary(details, load_suite_config(), {"cpu": "x"}, {"overlap": 1.0}, 3.0)
    assert s["overlap_speedup"] == 1.1 and s["goals"]["overlap_speedup"]["met"] is True
    assert s["spec_tpot_speedup"] is None and s["goals"]["spec_tpot_speedup"]["met"] is None
    assert set(HEADLINE) <= set(s) and "boom" in s["notes"]["spec"]
    table = format_table(s)
    assert "| overlap_speedup | 1.1 | ≥ 1 | yes | 11.0 vs 10.0 tok/s |" in table
    assert "| spec_tpot_speedup | — | ≥ 1.4 | n/a |" in table
    json.dumps(s)


def test_startup_row_says_what_the_warm_cache_refused():
    cache = {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 12}
    details = {
        "startup": {
            "startup_cold_s": 400.0,
            "startup_warm_s": 250.0,
            "startup_eager_s": 4.0,
            "batch_sizes": [1, 2],
            "cache_warm": cache,
        }
    }
    s = build_summary(details, load_suite_config(), {"cpu": "x"}, {"startup": 1.0}, 3.0)
    assert s["startup_warm_s"] == 250.0
    assert "0 hits, 0 misses, 12 refused" in s["notes"]["startup_warm_s"]


def test_bench_command_runs_a_workload_and_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    with FakeOpenAI(first_delay_s=0.01, token_delay_s=0.0) as server:
        rc = main(
            [
                "bench",
                "--url",
                server.url,
                "--workload",
                "shared_prefix",
                "--num-prompts",
                "5",
                "--set",
                "output_len=3",
                "--max-concurrency",
                "2",
                "--goodput",
                "ttft:5000",
                "--percentiles",
                "50,99",
                "--out",
                str(out),
            ]
        )
    assert rc == 0
    report = capsys.readouterr().out
    assert "Successful requests:" in report and "P99 TTFT" in report and "goodput" in report
    data = json.loads(out.read_text())
    assert data["metrics"]["completed"] == 5 and data["metrics"]["total_output_tokens"] == 15
    assert data["spec"]["kind"] == "shared_prefix" and len(server.bodies) == 5
    assert all(len(b["prompt"]) == 256 + 16 for b in server.bodies)


def test_bench_command_needs_a_url_or_the_suite():
    assert main(["bench", "--workload", "random"]) == 2
    assert main(["bench", "suite"]) == 2


def test_the_tiers_goals_are_read_at_one_operating_point():
    def row(router, on, computed, ttft):
        split = {"ttft_model_s": ttft, "queue_model_s": 0.0, "ttft_steps": 2.0}
        return {
            "router": router,
            "tiers": on,
            "computed_fraction": computed,
            "cached_fraction": 1 - computed,
            "mean_ttft_steps": 2.0,
            "split": split,
            "explain": {"oracle_cached_fraction": 0.77},
        }

    def point(scale):
        rows = [
            row("hybrid_prefix", False, 0.6, 0.06),
            row("hybrid_prefix", True, 0.3 * scale, 0.03 * scale),
            row("ray_prefix", True, 0.5, 0.7),
        ]
        goals = {
            "computed_prefill_tiers_over_device": 0.5 * scale,
            "ttft_model_s_tiers_over_device": 0.5 * scale,
            "cached_vs_ray": round(0.7 / 0.5, 3),
        }
        return {"results": rows, "goals": goals, "settings": {"host_factor": 2}, "table": "t", "split_table": "s"}

    tiers = {
        **point(1.0),
        "overloaded": point(1.5),
        "multi_turn": {"host": {"turn2_hits": 20}, "device": {"turn2_hits": 0}},
    }
    s = build_summary({"tiers": tiers}, load_suite_config(), {"cpu": "x"}, {"tiers": 1.0}, 3.0)
    assert (s["tiers_prefill_ratio"], s["tiers_ttft_ratio"], s["tiers_cached_vs_ray"]) == (0.5, 0.5, 1.4)
    assert "below capacity, host tier 2" in s["notes"]["tiers_ttft_ratio"]
    assert "overloaded 0.75" in s["notes"]["tiers_prefill_ratio"]
    assert "The same, overloaded" in format_table(s)
