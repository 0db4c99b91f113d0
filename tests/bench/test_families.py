"""The per-family decode benchmark runs and reports both sides (figures are not checked:
they mean something only on an idle machine)."""
from __future__ import annotations

import json

from cluster.bench.families import main


def test_families_bench_reports_one_line_per_family(capsys) -> None:
    main(["--families", "mamba2", "--batch", "2", "--out-tokens", "3", "--prompt-len", "5",
          "--repeats", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["family"] for r in rows] == ["mamba2"]
    row = rows[0]
    assert row["architecture"] == "Mamba2ForCausalLM" and row["batch"] == 2
    assert row["engine_tok_s"] > 0 and row["hf_generate_tok_s"] > 0
    assert abs(row["engine_over_hf"] - row["engine_tok_s"] / row["hf_generate_tok_s"]) < 0.01 * row["engine_over_hf"] + 1e-3
    assert len(row["loadavg_before"]) == 3
