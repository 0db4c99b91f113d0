"""Builders shared by the GDN, KDA, SSD and selective-scan tests, on the torch path
(``tests/kernels/test_*.py``) and the Triton path (``tests/kernels/triton_path/``): inputs,
lengths, case variants, the naive per-token driver over the slot pool, and the
pool-and-output comparison.

The batches themselves (``VarlenCase``) come from the ``varlen_case`` fixture in conftest.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch
from hypothesis import Phase
from hypothesis import strategies as st

if TYPE_CHECKING:
    from tests.kernels.conftest import VarlenCase

Inputs = dict[str, torch.Tensor]
Result = tuple[torch.Tensor, torch.Tensor]  # (output [T, H, ...], final pool)

# Shrinking re-runs interpreted kernels for minutes; a failure's example is printed as is.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def lens_strategy(short_max: int, max_size: int) -> st.SearchStrategy[list[int]]:
    """Batches of 1..max_size sequences: empty, decode, 2..short_max and 17..40 tokens (the
    last past the default recurrent/chunked boundary of 16)."""
    length = st.one_of(st.sampled_from([0, 1]), st.integers(2, short_max), st.integers(17, 40))
    return st.lists(length, min_size=1, max_size=max_size)


def gdn_inputs(
    num_tokens: int, num_slots: int, seed: int, heads_k: int, heads_v: int, k_dim: int, v_dim: int
) -> Inputs:
    """q, k [T, HK, K]; v [T, H, V]; g (log decay, <= 0), beta [T, H]; states [S, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(num_tokens, heads_k, k_dim, generator=gen),
        k=torch.randn(num_tokens, heads_k, k_dim, generator=gen),
        v=torch.randn(num_tokens, heads_v, v_dim, generator=gen),
        g=-torch.rand(num_tokens, heads_v, generator=gen) * 0.5,
        beta=torch.rand(num_tokens, heads_v, generator=gen),
        states=torch.randn(num_slots, heads_v, k_dim, v_dim, generator=gen),
    )


def kda_inputs(
    num_tokens: int, num_slots: int, seed: int, heads: int, k_dim: int, v_dim: int, g_min: float = -0.5
) -> Inputs:
    """q, k, g (log decay per key channel, in [g_min, 0]) [T, H, K]; v [T, H, V]; beta [T, H];
    states [S, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(num_tokens, heads, k_dim, generator=gen),
        k=torch.randn(num_tokens, heads, k_dim, generator=gen),
        v=torch.randn(num_tokens, heads, v_dim, generator=gen),
        g=torch.rand(num_tokens, heads, k_dim, generator=gen) * g_min,
        beta=torch.rand(num_tokens, heads, generator=gen),
        states=torch.randn(num_slots, heads, k_dim, v_dim, generator=gen),
    )


def ssd_inputs(num_tokens: int, num_slots: int, seed: int, heads: int, groups: int, p_dim: int, n_dim: int) -> Inputs:
    """x [T, H, P]; dt [T, H]; A, D, dt_bias [H]; B, C [T, G, N]; states [S, H, P, N]."""
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(num_tokens, heads, p_dim, generator=gen),
        dt=torch.randn(num_tokens, heads, generator=gen) - 1.0,
        A=-torch.rand(heads, generator=gen) * 2 - 0.1,
        B=torch.randn(num_tokens, groups, n_dim, generator=gen),
        C=torch.randn(num_tokens, groups, n_dim, generator=gen),
        D=torch.randn(heads, generator=gen),
        dt_bias=torch.randn(heads, generator=gen) * 0.5,
        states=torch.randn(num_slots, heads, p_dim, n_dim, generator=gen),
    )


def selective_scan_inputs(
    num_tokens: int, num_slots: int, seed: int, channels: int, n_dim: int, groups: int | None = None
) -> Inputs:
    """x, dt [T, H]; A [H, N] (< 0, one rate per channel and state); B, C [T, N] (or
    [T, G, N] with ``groups``); D, dt_bias [H]; states [S, H, N] (Mamba1, ``kernels.selective_scan``)."""
    gen = torch.Generator().manual_seed(seed)
    bc = (num_tokens, n_dim) if groups is None else (num_tokens, groups, n_dim)
    return dict(
        x=torch.randn(num_tokens, channels, generator=gen),
        dt=torch.randn(num_tokens, channels, generator=gen) - 1.0,
        A=-torch.rand(channels, n_dim, generator=gen) * 2 - 0.1,
        B=torch.randn(*bc, generator=gen),
        C=torch.randn(*bc, generator=gen),
        D=torch.randn(channels, generator=gen),
        dt_bias=torch.randn(channels, generator=gen) * 0.5,
        states=torch.randn(num_slots, channels, n_dim, generator=gen),
    )


def poison_no_init_slot(case: VarlenCase, states: torch.Tensor) -> None:
    """Fills with NaN the live slot of the first non-empty sequence without an initial state:
    an op that reads it anyway leaks NaN into that sequence's output and state."""
    no_init = next(b for b, n in enumerate(case.lens) if n > 0 and not case.has_initial_state[b])
    states[int(case.slot_ids[no_init])] = float("nan")


def with_snapshot_every_token(case: VarlenCase) -> tuple[VarlenCase, torch.Tensor]:
    """Speculative verify: case with a fresh snapshot slot after every token (slots
    ``num_slots ..`` appended to the pool). Returns (the case, its state_dst_slots [T])."""
    num_tokens = case.num_tokens
    dst = torch.arange(case.num_slots, case.num_slots + num_tokens, dtype=torch.int32)
    return dataclasses.replace(case, state_dst_slots=dst, num_slots=case.num_slots + num_tokens), dst


def naive_varlen(states: torch.Tensor, case: VarlenCase, step: Callable[[int, torch.Tensor], None]) -> torch.Tensor:
    """The slot-pool contract of the varlen ops, token by token; returns the final pool.

    For each sequence: start from its live slot if it has an initial state, else zeros
    (fp32, the slot unread); call ``step(t, s)`` for each of its tokens t, which updates the
    state s [H, ...] in place and writes row t of the caller's output; after token t copy s
    into ``state_dst_slots[t]`` when that is not 0; after the last token copy s into the live
    slot (an empty sequence leaves it untouched). ``states`` itself is not modified.
    """
    pool = states.clone()
    dst = case.state_dst_slots
    for b, (start, end) in enumerate(case.bounds()):
        slot = int(case.slot_ids[b])
        s = pool[slot].clone() if case.has_initial_state[b] else torch.zeros(pool.shape[1:])
        for t in range(start, end):
            step(t, s)
            if dst is not None and dst[t] != 0:
                pool[int(dst[t])] = s
        if end > start:
            pool[slot] = s
    return pool


def assert_same_result(
    got: Result, want: Result, tol: float, max_abs_diff: Callable[[torch.Tensor, torch.Tensor], float]
) -> None:
    """Output and whole pool (live, snapshot, dummy and spare slots) agree in dtype and to tol.

    The messages carry the numbers: pytest does not rewrite asserts outside test modules.
    """
    (out, pool), (ref, ref_pool) = got, want
    assert out.dtype == ref.dtype and pool.dtype == ref_pool.dtype, (out.dtype, ref.dtype, pool.dtype, ref_pool.dtype)
    out_diff = max_abs_diff(out, ref)
    assert out_diff <= tol, f"output: max abs diff {out_diff} > {tol}"
    pool_diff = max_abs_diff(pool, ref_pool)
    assert pool_diff <= tol, f"pool: max abs diff {pool_diff} > {tol}"
