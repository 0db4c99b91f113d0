"""The differential fuzz (``fuzz.py``): short runs here, long ones under ``slow``.

Guard on: no divergence from the reference, no invariant violation, no state mismatch, no
livelock. Guard off (``debug.disable_alias_guard``): the same fuzz must find the aliasing
bug -- its own sensitivity check. The ``tiers`` batches draw every case with the host tier
on: demotions, promotions and forced transfer failures must all have happened.
"""

from __future__ import annotations

import pytest

from tests.sim.fuzz import Control, fuzz

TOY_BATCHES = [range(i, i + 16) for i in range(0, 64, 16)]
# Seeds whose cases livelock a scheduler where the grower preempts itself while its victims
# are in flight, or re-admission demotes it: kept while ``draw`` is stable.
LIVELOCK_SEEDS = [81, 162, 196, 220]


def assert_clean(t) -> None:
    assert t.clean, (t.divergences, dict(t.violations), t.state_mismatches, t.livelocks, t.examples)
    assert t.state_checks > 0 and t.requests > 0


@pytest.mark.parametrize("seeds", TOY_BATCHES, ids=lambda r: f"{r.start}-{r.stop}")
def test_toy_fuzz(tiny_qwen_dir, seeds):
    assert_clean(fuzz(tiny_qwen_dir, seeds))


def test_toy_fuzz_former_livelocks(tiny_qwen_dir):
    assert_clean(fuzz(tiny_qwen_dir, LIVELOCK_SEEDS))


def assert_transfers(t) -> None:
    assert t.tiered == t.configs and t.demotions > 0 and t.promotions > 0 and t.transfer_failures > 0, t


@pytest.mark.parametrize("seeds", TOY_BATCHES[:2], ids=lambda r: f"{r.start}-{r.stop}")
def test_toy_fuzz_tiers(tiny_qwen_dir, seeds):
    t = fuzz(tiny_qwen_dir, seeds, tiers=True)
    assert_clean(t)
    assert_transfers(t)


def test_toy_fuzz_guard_off_finds_the_bug(tiny_qwen_dir):
    t = fuzz(tiny_qwen_dir, range(40), guard_off=True)
    assert t.state_mismatches > 0 and t.violations["I4"] > 0 and t.divergences > 0, t


@pytest.fixture(scope="module")
def control(tiny_qwen_dir):
    return Control(tiny_qwen_dir)


def test_real_fuzz(tiny_qwen_dir, control):
    t = fuzz(tiny_qwen_dir, range(3), real=True, control=control)
    assert_clean(t)
    assert t.hits > 0


# Tiered cases whose workload promotes (the toy target promotes 5 and 10 times on these).
# 23: a checkpoint published, evicted and its slot promoted into at once, before its queued
# state-oracle check ran (the oracle read the promoted state: it now copies at publish).
REAL_TIER_SEEDS = [5, 16, 23]


def test_real_fuzz_tiers(tiny_qwen_dir, control):
    t = fuzz(tiny_qwen_dir, REAL_TIER_SEEDS, real=True, control=control, tiers=True)
    assert_clean(t)
    assert t.promotions > 0 and t.demotions > 0


@pytest.mark.slow
@pytest.mark.parametrize("start", range(32, 1024, 64))
def test_toy_fuzz_tiers_long(tiny_qwen_dir, start):
    t = fuzz(tiny_qwen_dir, range(start, start + 64), tiers=True)
    assert_clean(t)
    assert_transfers(t)


@pytest.mark.slow
@pytest.mark.parametrize("start", range(3, 27, 8))
def test_real_fuzz_tiers_long(tiny_qwen_dir, control, start):
    assert_clean(fuzz(tiny_qwen_dir, range(start, start + 8), real=True, control=control, tiers=True))


@pytest.mark.slow
@pytest.mark.parametrize("start", range(64, 1024, 64))
def test_toy_fuzz_long(tiny_qwen_dir, start):
    assert_clean(fuzz(tiny_qwen_dir, range(start, start + 64)))


@pytest.mark.slow
@pytest.mark.parametrize("start", range(3, 43, 8))
def test_real_fuzz_long(tiny_qwen_dir, control, start):
    assert_clean(fuzz(tiny_qwen_dir, range(start, start + 8), real=True, control=control))
