"""The per-family decode benchmark runs and reports both sides (figures are not checked:
they mean something only on an idle machine)."""

from __future__ import annotations

import json

from tests.lab.families import main


def test_families_bench_reports_one_line_per_family(capsys) -> None:
    main(["--families", "mamba2", "--batch", "2", "--out-tokens", "4", "--prompt-len", "5", "--repeats", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["family"] for r in rows] == ["mamba2"]
    row = rows[0]
    assert row["architecture"] == "Mamba2ForCausalLM" and row["batch"] == 2
    # Under load a difference of two short timings may be noise (rate <= 0, ratio None).
    assert isinstance(row["engine_tok_s"], float) and isinstance(row["hf_generate_tok_s"], float)
    if row["engine_over_hf"] is not None:
        assert row["engine_over_hf"] > 0
    assert len(row["loadavg_before"]) == 3
