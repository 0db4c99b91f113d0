"""Issue 8 item 9, soak: a mixed load over two replicas with ``debug.check_invariants`` on.

Every shipped workload mixed, streaming and not, 5 % disconnects, 1 % invalid requests
(``cluster.bench.soak``). The contract (``SoakResult.problems``): no request fails (no
5xx, no unexpected 4xx, no transport error, no hang past the request timeout, no short or
truncated answer, every invalid request the right 4xx error object), zero invariant
violations on every replica, each replica's RSS grows < 10 % between the end of warm-up
and the end, the pools are back at their idle counts (flushed) at the end, and the engines
finished exactly the requests the client completed or dropped.

The 60-second variant runs by default; the 10-minute one is ``slow``.
"""
from __future__ import annotations

import pytest

from cluster.bench.soak import INVALID_KINDS, WORKLOADS, SoakSettings
from cluster.bench.soak_server import SoakResult, replica_pids, run_checked
from cluster.bench.workloads import Renderer

pytestmark = [pytest.mark.ray]
NUM_REPLICAS = 2
SOAK_OVERRIDES = {"debug": {"check_invariants": True}, "parallel": {"num_replicas": NUM_REPLICAS}}


@pytest.fixture(scope="module")
def soak_app(deployed, tiny_qwen_dir):
    app = deployed("soak", str(tiny_qwen_dir), overrides=SOAK_OVERRIDES, args={"model_name": "tiny-soak"})
    return app, Renderer.from_path(tiny_qwen_dir)


def _soak(soak_app, duration_s: float, warmup_s: float) -> SoakResult:
    app, renderer = soak_app
    pids = sorted(replica_pids(app.name).values())
    assert len(pids) == NUM_REPLICAS, pids
    settings = SoakSettings(duration_s=duration_s, warmup_s=warmup_s, concurrency=8, request_timeout_s=60.0)
    result = run_checked(app.base_url, settings, renderer=renderer, pids=pids)
    print("\n" + result.format())
    return result


def _check(result: SoakResult, min_requests: int) -> None:
    assert result.problems() == []
    fig = result.report.figures()
    outcomes, modes = fig["outcomes"], fig["by_mode"]
    # the load was the mix it claims to be (and large enough that 1 % is at least one request)
    assert fig["requests"] >= min_requests, fig
    assert set(fig["by_workload"]) == set(WORKLOADS)
    assert modes["stream"] > 0 and modes["plain"] > 0
    num_valid = fig["requests"] - modes["invalid"]
    assert modes["invalid"] == outcomes["rejected"] >= fig["requests"] // 100
    assert abs(modes["disconnect"] - 0.05 * num_valid) <= 1 and outcomes.get("disconnected", 0) > 0
    assert set(fig["invalid_kinds"]) <= set(INVALID_KINDS)
    assert len(result.pools_before) == NUM_REPLICAS and len(result.rss_end_kib) == NUM_REPLICAS


@pytest.mark.timeout(240)
def test_soak_one_minute(soak_app):
    _check(_soak(soak_app, duration_s=60.0, warmup_s=15.0), min_requests=100)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_ten_minutes(soak_app):
    result = _soak(soak_app, duration_s=600.0, warmup_s=60.0)
    _check(result, min_requests=1000)
    assert len(result.report.figures()["invalid_kinds"]) == len(INVALID_KINDS)
