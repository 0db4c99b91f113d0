"""RG-LRU (``kernels.rglru``) torch reference against transformers' formulas, token by token."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.recurrent_batch import RecurrentBatch
from kernels.rglru import rg_lru, softplus_scale
from tests.kernels.varlen_cases import naive_varlen, poison_no_init_slot

CHANNELS = 12


def rglru_inputs(num_tokens: int, num_slots: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(num_tokens, CHANNELS, generator=gen),
        gx=torch.randn(num_tokens, CHANNELS, generator=gen),
        ga=torch.randn(num_tokens, CHANNELS, generator=gen),
        param=torch.randn(CHANNELS, generator=gen) - 2.0,
        positions=torch.randint(0, 3, (num_tokens,), generator=gen),
        states=torch.randn(num_slots, CHANNELS, generator=gen),
    )


def hf_step(inp: dict[str, torch.Tensor], y: torch.Tensor):
    """transformers' RecurrentGemmaRglru, one token: the written-out formulas."""

    def step(t: int, s: torch.Tensor) -> None:
        reset = bool(inp["positions"][t] == 0)
        log_a = -8.0 * torch.sigmoid(inp["ga"][t]) * F.softplus(inp["param"])
        a = torch.exp(log_a) * (not reset)
        mult = 1.0 if reset else torch.sqrt(1 - torch.exp(2 * log_a))
        s.mul_(a).add_(inp["x"][t] * torch.sigmoid(inp["gx"][t]) * mult)
        y[t] = s

    return step


def run(inp: dict[str, torch.Tensor], seqs: RecurrentBatch) -> tuple[torch.Tensor, torch.Tensor]:
    pool = inp["states"].clone()
    scale = softplus_scale(inp["param"])
    y = rg_lru(inp["x"], inp["gx"], inp["ga"], scale, inp["positions"] == 0, pool, seqs)
    return y, pool


def test_varlen_matches_the_token_loop(varlen_case):
    """Empty, short (per-token) and long (chunked, several chunks) sequences, snapshots, a
    NaN no-init slot that must not leak, resets mid-sequence."""
    case = varlen_case([0, 1, 5, 150, 16, 17, 3], seed=2, snapshot_prob=0.2)
    inp = rglru_inputs(case.num_tokens, case.num_slots, seed=2)
    poison_no_init_slot(case, inp["states"])
    want_y = torch.zeros(case.num_tokens, CHANNELS)
    want_pool = naive_varlen(inp["states"], case, hf_step(inp, want_y))
    y, pool = run(inp, case.seqs())
    torch.testing.assert_close(y, want_y, rtol=0, atol=1e-5)
    torch.testing.assert_close(pool, want_pool, rtol=0, atol=1e-5, equal_nan=True)


def test_decode_form_equals_varlen(varlen_case):
    case = varlen_case([1, 1, 1, 1], seed=5, init_prob=1.0)
    inp = rglru_inputs(case.num_tokens, case.num_slots, seed=5)
    got = run(inp, case.seqs(uniform_len=1))
    want = run(inp, case.seqs())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
