"""The device-check script, run here as a dry run: every stage at toy sizes on the CPU (Triton
through its interpreter), so the script and its stages are known to parse and wire up on a
machine without a GPU. The numbers mean nothing; the rows must pass and the tables exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "run_device_checks.sh"
TITLES = [
    "### Environment",
    "### (a) kernels",
    "### (b) whole-model",
    "### (c) decode throughput",
    "### (c2) the engine",
    "### (c3) profiler window",
]


def test_dry_run_of_every_stage(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OUT")}
    env.update(OUT=str(tmp_path), PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    summary = (tmp_path / "summary.md").read_text()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    positions = [summary.find(title) for title in TITLES]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), summary[:2000]
    assert "FAIL" not in summary and "skipped" not in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 30  # every stage wrote its rows
    for stage in ("env", "kernels", "model", "bench"):
        assert (tmp_path / f"{stage}.log").stat().st_size > 0
    assert (tmp_path / "profile_b2.json.gz").stat().st_size > 0  # the profiler window's trace


def test_wheels_fetched_are_the_wheels_documented():
    """fetch_wheels.sh downloads exactly what run_device_checks.sh's header says it does."""
    fetch = (ROOT / "tests" / "gpu" / "fetch_wheels.sh").read_text()
    listed = re.search(r'WHEELS="([^"]+)"', fetch).group(1).split()
    header = "".join(line.lstrip("# ").rstrip("\\") for line in SCRIPT.read_text().splitlines() if line.startswith("#"))
    documented = re.findall(r"[a-z][a-z-]*==[0-9.]+", header)
    assert sorted(listed) == sorted(documented)
    assert "pydantic==" in fetch  # what the engine's config needs there
