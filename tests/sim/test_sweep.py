"""A fixed random sweep of engine configurations over the toy model (guard on): every
oracle clean, every output equal to the analytic greedy continuation (see sweep.py)."""
from __future__ import annotations

import pytest

from tests.sim.sweep import draw, run_case

SEEDS = range(16)


@pytest.mark.parametrize("seed", SEEDS)
def test_sweep(tiny_qwen_dir, seed):
    run_case(tiny_qwen_dir, draw(seed))
