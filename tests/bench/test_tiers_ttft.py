"""The TTFT split and the modelled step cost of ``cluster/bench/tiers_ttft.py``: exact on
made-up inputs, and consistent with ``bench/tiers.py``'s own TTFT on a small run."""

from __future__ import annotations

import pytest

from cluster.bench.tiers_ttft import RequestTimes, StepCost, batch_shape, fit_step_cost, ttft_split
from workers.request import Request
from workers.sampling.params import SamplingParams
from workers.scheduler_types import ScheduledBatch, ScheduledSeq


def test_fit_recovers_the_cost_and_refuses_too_few_shapes():
    truth = StepCost(0.01, 2e-4, 3e-3)
    samples = [(c, r, truth(c, r)) for c in (0, 16, 200, 256) for r in (0, 1, 3)]
    fit = fit_step_cost(samples)
    assert (fit.a, fit.b, fit.c) == pytest.approx((truth.a, truth.b, truth.c), rel=1e-6)
    with pytest.raises(ValueError, match="3 or more distinct"):
        fit_step_cost([(0, 1, 0.01), (16, 1, 0.02)] * 5)


def test_batch_shape_counts_prompt_tokens_and_decode_rows():
    def req(n_prompt: int, n_out: int) -> Request:
        r = Request("r", list(range(1, n_prompt + 1)), SamplingParams(max_tokens=8))
        r.output_token_ids = [5] * n_out
        return r

    seqs = (
        ScheduledSeq(req(40, 0), 0, 32, samples=False),  # a prefill chunk
        ScheduledSeq(req(10, 0), 0, 10, samples=True),  # the last chunk, sampling
        ScheduledSeq(req(10, 3), 12, 1, samples=True),  # a decode
        ScheduledSeq(req(9, 0), 8, 1, samples=True),
    )  # a 1-token last chunk: prompt
    assert batch_shape(ScheduledBatch(0, seqs, ())) == (43, 1)


def test_split_means_add_up():
    times = [
        RequestTimes(0, 0.0, 3, 0.05, 4, 0.07),
        RequestTimes(2, 0.03, 2, 0.03, 5, 0.09),
        RequestTimes(4, 0.1),
    ]  # no first token yet: left out
    sp = ttft_split([type("Log", (), {"times": {str(i): t for i, t in enumerate(times)}})()])
    assert sp["requests"] == 2 and sp["max_ttft_steps"] == 4
    assert (sp["queue_steps"], sp["prefill_steps"], sp["ttft_steps"]) == (1.5, 2.0, 3.5)
    assert sp["queue_model_s"] == pytest.approx(0.025) and sp["ttft_model_s"] == pytest.approx(0.065)
