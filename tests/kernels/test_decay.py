"""``kernels.decay.decay_exp``: exp of the chunked scans' log-decays, 0 below ``MIN_LOG``,
and the chunked forms with strong decays (most factors of a chunk out of fp32's range)
still equal to their per-token recurrences."""

from __future__ import annotations

import math

import torch

from kernels.decay import MIN_LOG, decay_exp
from kernels.gdn import reference as gdn
from kernels.ssd import reference as ssd


def test_exp_above_the_floor_zero_below():
    x = torch.tensor([0.0, -1.0, MIN_LOG, MIN_LOG - 1e-3, -100.0, -1e4, float("-inf")])
    y = decay_exp(x)
    assert torch.equal(y[:3], x[:3].exp())
    assert torch.equal(y[3:], torch.zeros(4))
    assert torch.isfinite(y).all() and not torch.isnan(y).any()
    assert math.exp(MIN_LOG) > torch.finfo(torch.float32).tiny * 1e3  # normal: no denormal products


def test_no_denormal_factors():
    """Every factor is 0 or a normal float (a denormal slows each product it enters)."""
    y = decay_exp(-torch.linspace(0, 200, 20001))
    nonzero = y[y != 0]
    assert (nonzero >= torch.finfo(torch.float32).tiny).all()


def _strong_gdn(num_tokens: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = gdn.l2norm(torch.randn(num_tokens, 2, 16, generator=gen)) * 16**-0.5
    k = gdn.l2norm(torch.randn(num_tokens, 2, 16, generator=gen))
    v = torch.randn(num_tokens, 4, 8, generator=gen)
    g = -torch.rand(num_tokens, 4, generator=gen) * 12.0  # up to -12 a token: -770 a chunk
    beta = torch.rand(num_tokens, 4, generator=gen)
    return (q, k, v, g, beta), torch.randn(4, 16, 8, generator=gen)


def test_gdn_chunked_with_strong_decays_equals_recurrent(max_abs_diff):
    seq, s0 = _strong_gdn(150, seed=3)
    o_c, s_c = gdn.gdn_chunked(seq, s0.clone(), chunk_size=64)
    valid = torch.ones(1, 150, dtype=torch.bool)
    o_r, s_r = gdn.gdn_recurrent(tuple(x[None] for x in seq), valid, s0[None].clone())
    assert max_abs_diff(o_c, o_r[0]) <= 1e-4
    assert max_abs_diff(s_c, s_r[0]) <= 1e-4


def test_ssd_chunked_with_strong_decays_equals_recurrent(max_abs_diff):
    gen = torch.Generator().manual_seed(5)
    n, heads, p, groups, state = 130, 4, 6, 2, 8
    x = torch.randn(n, heads, p, generator=gen)
    step = torch.rand(n, heads, generator=gen) * 2.0
    b, c = torch.randn(n, groups, state, generator=gen), torch.randn(n, groups, state, generator=gen)
    A = -torch.rand(heads, generator=gen) * 8.0 - 1.0  # dt' A down to -18 a token
    s0 = torch.randn(heads, p, state, generator=gen)
    y_c, s_c = ssd.ssd_chunked((x, step, b, c), s0.clone(), A=A, chunk_size=64)
    valid = torch.ones(1, n, dtype=torch.bool)
    y_r, s_r = ssd.ssd_recurrent((x[None], step[None], b[None], c[None]), valid, s0[None].clone(), A=A)
    assert max_abs_diff(y_c, y_r[0]) <= 1e-4
    assert max_abs_diff(s_c, s_r[0]) <= 1e-4
