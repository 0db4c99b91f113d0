"""Whole tiny models on CUDA: greedy tokens with the GPU kernels equal the torch path's (the
rows of stage (b) of the device checks, ``tests/gpu/checks_model.py``, as tests)."""

from __future__ import annotations

import pytest

from tests.gpu import checks_model

CASES = checks_model.cases(dry_run=False)


@pytest.mark.parametrize("name,run,ref,tie", CASES, ids=[f"{n}-{r.dtype}" for n, r, _, _ in CASES])
def test_greedy_equal(name, run, ref, tie, tmp_path):
    pytest.importorskip("pydantic")  # the engine's config (carried as a wheel)
    from tools.tiny import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(name.split("+")[0], tmp_path, seed=0, mtp="+mtp" in name)
    got, want = checks_model.generate(model_dir, run), checks_model.generate(model_dir, ref)
    outcome = checks_model.compare_greedy(got, want, tie)
    assert outcome.ok, outcome.divergence
    assert len({t for out in want for t in out.token_ids}) > 4  # not a collapsed output
