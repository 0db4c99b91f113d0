from __future__ import annotations

import pytest
import torch

from workers.sampling.params import SEED_RANGE, SamplingParams, nth_seed
from workers.sampling.sampler import GeneratorBank, _filter_top_k_top_p, sample


def logits(n=4, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 3


def draw(lg, params, bank, rids):
    gens = [bank.get(r, p.seed) for r, p in zip(rids, params)]
    return sample(lg, params, gens).token_ids.tolist()


def test_greedy_is_argmax():
    lg = logits()
    out = sample(lg, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert out.token_ids.tolist() == lg.argmax(-1).tolist()


def test_top_k_one_equals_greedy():
    lg = logits()
    bank = GeneratorBank(0, torch.device("cpu"))
    p = SamplingParams(temperature=1.3, top_k=1)
    assert draw(lg, [p] * 4, bank, list("abcd")) == lg.argmax(-1).tolist()


def test_seeded_rows_reproducible_and_batch_independent():
    lg = logits(n=3)
    seeded = SamplingParams(temperature=1.0, seed=123)
    runs = []
    for companions in (0, 2):
        bank = GeneratorBank(99 + companions, torch.device("cpu"))
        toks = []
        for step in range(20):
            params = [seeded] + [SamplingParams(temperature=1.0)] * companions
            toks.append(draw(lg[: 1 + companions], params, bank, ["s"] + [f"o{i}" for i in range(companions)])[0])
        runs.append(toks)
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # actually sampling, not argmax


def test_top_p_keeps_nucleus_only():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(_filter_top_k_top_p(row, 0, 0.7))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(_filter_top_k_top_p(row, 0, 0.5))
    assert kept.tolist() == [True, False, False, False]
    kept = torch.isfinite(_filter_top_k_top_p(row, 3, 1.0))
    assert kept.tolist() == [True, True, True, False]


def test_sampled_frequencies_follow_temperature_scaled_distribution():
    row = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = SamplingParams(temperature=0.7, seed=5)
    bank = GeneratorBank(0, torch.device("cpu"))
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[draw(row, [p], bank, ["x"])[0]] += 1
    expected = torch.softmax(row[0] / 0.7, -1)
    assert torch.allclose(counts / 4000, expected, atol=0.03)


def test_logprobs_returned_for_asking_rows():
    lg = logits(n=2)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)]
    out = sample(lg, params, [None, None])
    ref = torch.log_softmax(lg, -1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids.view(-1, 1)).view(-1))
    assert out.top_ids.shape == (2, 3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        (
            {"seed": 2**64},
            r"seed must be an integer in \[-9223372036854775808, 9223372036854775807\], got "
            r"18446744073709551616",
        ),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"best_of": 10**6}, r"best_of must be an integer in \[1, 16\], got 1000000"),
        ({"best_of": 0}, "best_of"),
    ],
)
def test_bad_params_raise_with_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_extreme_but_valid_params_never_break_sampling():
    """Found by fuzzing the HTTP API: a subnormal temperature or top_p killed the engine loop."""
    lg = logits(n=3)
    params = [
        SamplingParams(temperature=1.4e-45, seed=1),
        SamplingParams(temperature=0.9, top_p=5e-324, seed=2),
        SamplingParams(temperature=2.0, top_p=1e-30, top_k=3, seed=3),
    ]
    assert params[0].is_greedy and not params[1].is_greedy
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    out = sample(lg, params, gens)
    assert out.token_ids.tolist() == lg.argmax(-1).tolist()  # each collapses to the top token


def test_nth_seed_stays_a_seed():
    low, high = SEED_RANGE
    assert nth_seed(None, 3) is None and nth_seed(5, 0) == 5 and nth_seed(5, 2) == 7
    assert nth_seed(high, 1) == low and nth_seed(high, 2) == low + 1
    for n in range(4):
        SamplingParams(seed=nth_seed(high - 1, n))  # every successor is a valid seed
