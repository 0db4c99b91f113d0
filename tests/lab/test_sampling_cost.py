"""The sampling-cost benchmark runs (its figures are taken on an idle machine, not here)."""

from __future__ import annotations

import json

from tests.lab.sampling_cost import main


def test_sampling_cost_runs_every_variant(capsys):
    main(["--tiny", "--batch", "2", "--out-tokens", "4", "--repeats", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in lines] == [
        "greedy",
        "greedy_json_schema",
        "greedy_penalties",
        "sampled",
        "sampled_penalties_filters",
    ]
    assert all(r["decode_tok_s"] > 0 for r in lines)
    assert next(r for r in lines if r["variant"] == "greedy_json_schema")["constrained_steps"] == 1.0
