"""The fetch-or-recompute cost model and the throughput estimate (pure)."""

from __future__ import annotations

import pytest

from workers.tiers.cost import FetchCost, Throughput


def cost(**kw) -> FetchCost:
    base = dict(
        bytes_to_move=100_000_000,
        tokens_to_recompute=1000,
        bandwidth_bytes_per_s=1e9,
        prefill_tokens_per_s=5000.0,
        latency_s=0.01,
        margin=0.1,
    )
    return FetchCost(**{**base, **kw})


def test_seconds_on_both_sides():
    c = cost()
    assert c.fetch_s == pytest.approx(0.01 + 0.1)
    assert c.recompute_s == pytest.approx(0.2)
    assert c.should_fetch  # 0.11 < 0.9 * 0.2


@pytest.mark.parametrize(
    "change, fetch",
    [
        ({"tokens_to_recompute": 500}, False),  # 0.11 vs 0.9 * 0.1: recompute
        ({"bandwidth_bytes_per_s": 2e8}, False),  # 0.51 s to move it
        ({"prefill_tokens_per_s": 1e6}, False),  # a fast prefill never loses
        ({"tokens_to_recompute": 0}, False),  # nothing to save
        ({"latency_s": 0.2}, False),
        ({"bytes_to_move": 0, "latency_s": 0.0}, True),
    ],
)
def test_the_decision_follows_the_named_inputs(change, fetch):
    assert cost(**change).should_fetch is fetch


def test_a_tie_within_the_margin_recomputes():
    c = cost(bytes_to_move=0, latency_s=0.19, margin=0.1)  # 0.19 s vs 0.2 s
    assert c.fetch_s < c.recompute_s and not c.should_fetch
    assert cost(bytes_to_move=0, latency_s=0.19, margin=0.0).should_fetch


@pytest.mark.parametrize(
    "bad",
    [
        {"bandwidth_bytes_per_s": 0},
        {"prefill_tokens_per_s": -1},
        {"bytes_to_move": -1},
        {"margin": 1.0},
        {"latency_s": -0.1},
    ],
)
def test_out_of_range_inputs_are_refused(bad):
    with pytest.raises(ValueError):
        cost(**bad)


def test_throughput_moves_towards_observations_and_ignores_empty_ones():
    t = Throughput(prior=100.0, weight=0.5)
    t.observe(0, 1.0)
    t.observe(10, 0.0)
    assert t.value == 100.0 and t.num_observations == 0
    t.observe(300, 1.0)  # 300/s
    assert t.value == pytest.approx(200.0)
    t.observe(600, 2.0)
    assert t.value == pytest.approx(250.0) and t.num_observations == 2
    with pytest.raises(ValueError):
        Throughput(prior=0.0)
