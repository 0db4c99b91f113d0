"""The per-hop bench (``tests.lab.http_hops``) runs its in-process layers, and
``proc_cpu`` counts the CPU of the processes below this one (no timing asserted)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.bench.proc_cpu import PROC, cpu_delta, role, snapshot
from tests.lab.http_hops import EXTRA, LAYERS, main, report

BUSY = (
    "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    "print('done', flush=True)\nsys.stdin.read()"
)


@pytest.mark.skipif(not PROC.is_dir(), reason="needs /proc")
def test_cpu_delta_counts_a_busy_child_and_its_threads():
    before = snapshot()
    child = subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        after = snapshot()
    finally:
        child.communicate("")
    delta = cpu_delta(before, after)
    # it started after ``before``: from 0
    assert child.pid in delta and delta[child.pid].cpu_s >= 0.25
    assert sum(s for _, s in delta[child.pid].threads.values()) >= 0.25
    assert role(delta[child.pid].name, {"client": {child.pid}}, child.pid) == "client"
    assert role("ray::ServeReplica:app:EngineReplica") == "replica" and role("ray::ProxyActor") == "proxy"


def test_in_process_layers_run_and_report(tiny_qwen_dir, tmp_path):
    out = tmp_path / "hops.json"
    result = main(
        [
            "--model",
            str(tiny_qwen_dir),
            "--no-serve",
            "--batch",
            "2",
            "--prompt-len",
            "8",
            "--output-len",
            "6",
            "--repeats",
            "1",
            "--stream-interval-s",
            "0",
            "--eager",
            "--out",
            str(out),
        ]
    )  # eager: the layers, not compilation (tests/workers/compiled)
    best = result["in_process"]["tok_s"]
    assert all(best[name] > 0 for name in LAYERS) and all(best[name] >= 0 for name in EXTRA)
    assert "ingress" in report(result) and out.is_file()
