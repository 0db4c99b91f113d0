"""The Mamba2 families clamp dt as their transformers classes do, checked against the formula.

Nemotron-H, Granite-4.0-H, Bamba, Falcon-H1 and Mamba2 clamp ``softplus(dt + dt_bias)`` to
``time_step_limit`` (Nemotron-H since transformers 5.25, as mamba_ssm and vLLM; 5.24, the
pinned oracle, clamped it below at ``time_step_min`` and so cannot judge it); Zamba2 clamps it
below at ``time_step_min`` in both. The oracle is the same model whose scans are handed the
formula's dt, already discretized: logits must not move.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.workers.models.harness import Harness, random_prompts
from tests.workers.models.test_vs_transformers import TOL, max_diff

LIMIT = (0.05, 0.2)
TIME_STEP_MIN = 0.1  # inside LIMIT: a clamp at it differs from LIMIT's on both sides
# family -> the clamp its transformers class applies with the configs below
EXPECTED_CLAMP = {
    "nemotron_h": LIMIT,
    "granitemoehybrid": LIMIT,
    "bamba": LIMIT,
    "falcon_h1": LIMIT,
    "mamba2": LIMIT,
    "zamba2": (TIME_STEP_MIN, math.inf),
}


def formula_scans(monkeypatch: pytest.MonkeyPatch, clamp: tuple[float, float]) -> list[torch.Tensor]:
    """Make the mixer's scans take ``clamp(softplus(dt + dt_bias), *clamp)`` precomputed (no
    bias, no softplus, no clamp of their own); returns the unclamped ``softplus`` values seen."""
    import workers.models.mamba2 as mixer_module

    seen: list[torch.Tensor] = []

    def formula(scan):
        def call(x, dt, a, b, c, d, dt_bias, *args, dt_softplus, dt_limit, **kwargs):
            assert dt_softplus
            step = F.softplus(dt.float() + dt_bias.float())
            seen.append(step)
            return scan(
                x,
                step.clamp(*clamp).to(dt.dtype),
                a,
                b,
                c,
                d,
                torch.zeros_like(dt_bias),
                *args,
                dt_softplus=False,
                dt_limit=(0.0, math.inf),
                **kwargs,
            )

        return call

    for name in ("ssd_scan",):
        monkeypatch.setattr(mixer_module, name, formula(getattr(mixer_module, name)))
    return seen


def prefill_and_decode(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    harness = Harness(model)
    logits = harness.prefill(prompts)
    return logits + harness.decode([int(x[-1].argmax()) for x in logits])


@pytest.mark.parametrize("name", sorted(EXPECTED_CLAMP))
def test_dt_clamp_follows_the_formula(name: str, tmp_path, monkeypatch) -> None:
    from tools.tiny import make_tiny_checkpoint
    from workers.loader import load_model

    limit_field = {} if name == "zamba2" else {"time_step_limit": LIMIT}  # Zamba2 has none
    ckpt = make_tiny_checkpoint(name, tmp_path, seed=2, time_step_min=TIME_STEP_MIN, **limit_field)
    model = load_model(ckpt, torch.float32, "cpu").model
    prompts = random_prompts(model.config.vocab_size, [5, 23], seed=3)
    got = prefill_and_decode(model, prompts)
    seen = formula_scans(monkeypatch, EXPECTED_CLAMP[name])
    want = prefill_and_decode(model, prompts)
    for a, b in zip(got, want):
        assert max_diff(a, b) <= TOL
    steps = torch.cat([s.flatten() for s in seen])
    # the old and the new clamp differ here: values below TIME_STEP_MIN and above LIMIT's top
    assert bool((steps < LIMIT[0]).any()) and bool((steps > LIMIT[1]).any()), steps.aminmax()
