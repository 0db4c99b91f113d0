"""Soak: a mixed load over two replicas with ``debug.check_invariants`` on.

Every shipped workload mixed, streaming and not, 5 % disconnects, 1 % invalid requests
(``tests.reliability.soak``). The contract (``SoakResult.problems``): no request fails (no
5xx, no unexpected 4xx, no transport error, no hang past the request timeout, no short or
truncated answer, every invalid request the right 4xx error object), zero invariant
violations on every replica, each replica's RSS grows < 10 % between the end of warm-up
and the end, the pools are back at their idle counts (flushed) at the end, and the engines
finished exactly the requests the client completed or dropped.

The 30-second variant runs by default (~300 requests: every workload, 1 % invalid is >= 1);
its RSS is read after 20 s, since the first seconds of the mix raise each replica's heap to
its working set; the 10-minute one is ``slow`` and reads it after 60 s.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from cluster.api.protocol import CompletionRequest
from cluster.bench.workloads import Renderer
from tests.reliability.soak import (
    INVALID_KINDS,
    WORKLOADS,
    SoakRecord,
    SoakReport,
    SoakSettings,
    WorkloadMix,
    invalid_body,
)
from tests.reliability.soak_server import ORACLE_CHECKS, SoakResult, replica_pids, run_checked

NUM_REPLICAS = 2
SOAK_OVERRIDES = {
    "debug": {"check_invariants": True, "state_oracle_sample": 0.25},
    "parallel": {"num_replicas": NUM_REPLICAS},
}


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
    # the state oracle recomputed published checkpoints (and problems() found no mismatch)
    assert result.counters_delta.get(ORACLE_CHECKS, 0) > 0, result.counters_delta


@pytest.mark.ray
@pytest.mark.timeout(360)  # deploy (up to ~100 s on a loaded machine) + 30 s
def test_soak_half_a_minute(soak_app):
    _check(_soak(soak_app, duration_s=30.0, warmup_s=20.0), min_requests=100)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_ten_minutes(soak_app):
    result = _soak(soak_app, duration_s=600.0, warmup_s=60.0)
    _check(result, min_requests=1000)
    assert len(result.report.figures()["invalid_kinds"]) == len(INVALID_KINDS)


# -- the driver's own logic, no server ------------------------------------------------------------
def test_mix_spreads_invalid_and_disconnected_requests_exactly():
    mix = WorkloadMix(SoakSettings(seed=3))
    modes = [mix.mode() for _ in range(2000)]
    kinds = Counter(m.split(":")[0] for m in modes)
    assert kinds["invalid"] == 20 and abs(kinds["disconnect"] - 0.05 * 1980) <= 1
    is_invalid = [m.startswith("invalid:") for m in modes]
    assert all(sum(is_invalid[i : i + 100]) == 1 for i in range(0, 2000, 100))  # one in each 100
    assert {m[8:] for m in modes if m.startswith("invalid:")} == set(INVALID_KINDS)
    assert 0.4 < kinds["stream"] / (kinds["stream"] + kinds["plain"]) < 0.6
    assert {mix.next()[0].name for _ in range(200)} == set(WORKLOADS)


def test_invalid_bodies_break_the_request_schema():
    body = {"model": "m", "prompt": [20, 21, 22], "max_tokens": 4}
    for kind in sorted(set(INVALID_KINDS) - {"unknown_model", "prompt_too_long", "malformed_json"}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(invalid_body(kind, body, 64))
    assert len(invalid_body("prompt_too_long", body, 64)["prompt"]) > 64
    with pytest.raises(ValueError):
        json.loads(invalid_body("malformed_json", body, 64))
    with pytest.raises(ValueError, match="unknown invalid kind"):
        invalid_body("nope", body, 64)


def _result(**changes) -> SoakResult:
    pools = {"r0": {"kv_pages_free": 8, "mamba_slots_free": 4}}
    ok = [
        SoakRecord("random", "plain", "ok", 200, 0.0, 1.0),
        SoakRecord("random", "disconnect", "disconnected", 200, 0.0, 0.1),
    ]
    fields = dict(
        report=SoakReport(ok, 1.0, "m"),
        pools_before=pools,
        pools_after=pools,
        violations={"0": {}},
        counters_delta={
            "hybridserve_requests_total{length}": 1,
            "hybridserve_requests_total{abort}": 1,
            "hybridserve_invariant_checks_total": 5,
        },
        rss_warm_kib={7: 1000},
        rss_end_kib={7: 1050},
    )
    return SoakResult(**{**fields, **changes})


def test_problems_name_every_broken_promise():
    assert _result().problems() == []
    failed = SoakRecord("random", "stream", "http_5xx", 503, 0.0, 1.0, "HTTP 503 ...")
    assert "1 x http_5xx" in _result(report=SoakReport([failed], 1.0, "m")).problems()[0]
    assert "invariant" in _result(violations={"0": {"I3": 2}}).problems()[0]
    assert "pools" in _result(pools_after={"r0": {"kv_pages_free": 7, "mamba_slots_free": 4}}).problems()[0]
    assert "RSS" in _result(rss_end_kib={7: 1100}).problems()[0]
    lost = {"hybridserve_requests_total{length}": 1, "hybridserve_invariant_checks_total": 5}
    assert "the engines finished 1" in _result(counters_delta=lost).problems()[0]
    unchecked = {"hybridserve_requests_total{length}": 1, "hybridserve_requests_total{abort}": 1}
    assert "no invariant checks ran" in _result(counters_delta=unchecked).problems()[0]
