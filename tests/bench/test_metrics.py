"""Metric definitions on hand-made timings: vLLM's TTFT / TPOT / ITL / E2EL, throughput,
goodput and numpy-compatible percentiles, checked to exact values."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.bench.metrics import (
    RequestRecord,
    compute_metrics,
    format_report,
    is_good,
    max_in_flight,
    parse_slos,
    percentile,
)

# Three successful requests and one failure; times in seconds.
A = RequestRecord(
    True, start=0.0, ttft=0.1, e2el=0.5, itl=(0.1, 0.1, 0.2), prompt_tokens=10, output_tokens=5, cached_tokens=4
)  # TPOT = 0.4 / 4 = 0.1
B = RequestRecord(
    True, start=0.2, ttft=0.3, e2el=0.9, itl=(0.3, 0.3), prompt_tokens=20, output_tokens=3, cached_tokens=0
)  # TPOT = 0.6 / 2 = 0.3
C = RequestRecord(
    True, start=1.0, ttft=0.2, e2el=0.2, itl=(), prompt_tokens=30, output_tokens=1, cached_tokens=30
)  # one token: no TPOT, 0 for goodput
F = RequestRecord(False, start=0.4, error="HTTP 500")


def test_tpot_is_e2e_minus_ttft_over_later_tokens():
    assert A.tpot == pytest.approx(0.1) and B.tpot == pytest.approx(0.3)
    assert C.tpot is None and F.tpot is None


def test_latency_summaries_follow_vllm():
    m = compute_metrics([A, B, C, F], duration_s=2.0)
    assert (m.completed, m.failed) == (3, 1)
    assert m.ttft_ms.mean == pytest.approx(200.0) and m.ttft_ms.median == pytest.approx(200.0)
    assert m.tpot_ms.mean == pytest.approx(200.0)  # C has no TPOT; F failed
    assert m.tpot_ms.median == pytest.approx(200.0)
    assert m.itl_ms.mean == pytest.approx(1000 * 1.0 / 5)  # pooled gaps: .1 .1 .2 .3 .3
    assert m.itl_ms.median == pytest.approx(100.0 * 2)
    assert m.e2el_ms.mean == pytest.approx(1000 * 1.6 / 3)
    assert m.ttft_ms.std == pytest.approx(1000 * np.std([0.1, 0.3, 0.2]))
    assert m.ttft_ms.percentiles["p99"] == pytest.approx(1000 * np.percentile([0.1, 0.3, 0.2], 99))


def test_throughputs_count_successes_over_wall_time():
    m = compute_metrics([A, B, C, F], duration_s=2.0)
    assert m.total_input_tokens == 60 and m.total_output_tokens == 9
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(34.5)
    assert m.cached_fraction == pytest.approx(34 / 60)
    assert m.concurrency == pytest.approx(1.6 / 2.0)
    assert m.request_goodput is None  # no SLO given


def test_goodput_needs_every_slo_and_counts_one_token_tpot_as_zero():
    slos = {"ttft": 250.0, "tpot": 150.0}
    assert is_good(A, slos) and not is_good(B, slos) and is_good(C, slos) and not is_good(F, slos)
    m = compute_metrics([A, B, C, F], duration_s=2.0, slos_ms=slos)
    assert m.request_goodput == pytest.approx(2 / 2.0)
    assert compute_metrics([A, B, C], 1.0, {"e2el": 500.0}).request_goodput == pytest.approx(2.0)
    assert is_good(A, {"ttft": 100.0})  # at the SLO is within it


def test_empty_and_all_failed_runs_give_zeros():
    m = compute_metrics([F], duration_s=1.0)
    assert m.completed == 0 and m.ttft_ms.mean == 0.0 and m.tpot_ms.percentiles == {"p99": 0.0}


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy(q):
    rng = random.Random(q)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)


def test_max_in_flight_counts_overlaps_and_back_to_back_requests():
    recs = [
        RequestRecord(True, start=0.0, e2el=1.0),
        RequestRecord(True, start=0.5, e2el=1.0),
        RequestRecord(True, start=1.0, e2el=1.0),
        RequestRecord(True, start=0.6, e2el=0.1),
    ]
    assert max_in_flight(recs) == 3


def test_parse_slos_and_bad_input():
    assert parse_slos(["ttft:2000", "tpot:250"]) == {"ttft": 2000.0, "tpot": 250.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
    with pytest.raises(ValueError):
        compute_metrics([A], 0.0)
    with pytest.raises(ValueError):
        compute_metrics([A], 1.0, {"latency": 1.0})


def test_report_names_every_metric():
    text = format_report(compute_metrics([A, B, C, F], 2.0, {"ttft": 250.0}))
    for word in ("TTFT", "TPOT", "ITL", "E2EL", "goodput", "P99", "Failed requests"):
        assert word in text
