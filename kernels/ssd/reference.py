"""Mamba2 SSD (Granite-4.0-H, Nemotron-H, Bamba), torch reference: the ground truth and CPU path.

Per head h, state S [P, N], group of the head ``h // (H // G)``:

    dt'_t = clamp(softplus(dt_t + dt_bias), *dt_limit)     (softplus only if dt_softplus)
    S_t   = exp(dt'_t * A) * S_{t-1} + dt'_t * x_t B_t^T
    y_t   = S_t C_t + D * x_t

dt' is computed once for all tokens before any path runs, so the chunked and the per-token
paths use the same clamp rule (transformers clamps only in its chunked path).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import OnStep, scan_varlen
from kernels.decay import decay_exp
from kernels.recurrent_batch import Path, RecurrentBatch
from kernels.static import scatter_rows_

# Segments of at most this many tokens take the per-token recurrence; longer ones are chunked.
RECURRENT_MAX_LEN = 16


def discretize_dt(dt: Tensor, dt_bias: Tensor, dt_softplus: bool, dt_limit: tuple[float, float]) -> Tensor:
    """The one dt rule of every path: [T, H] raw -> [T, H] fp32 step sizes."""
    dt = dt.float() + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def check_shapes(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, states: Tensor) -> None:
    num_tokens, num_heads, head_dim = x.shape
    groups, state_dim = B.shape[1], B.shape[2]
    ok = (
        dt.shape == (num_tokens, num_heads)
        and B.shape[0] == num_tokens
        and C.shape == B.shape
        and num_heads % groups == 0
        and states.shape[1:] == (num_heads, head_dim, state_dim)
    )
    if not ok:
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
            f"B {tuple(B.shape)}, C {tuple(C.shape)}, states {tuple(states.shape)}"
        )


def ssd_torch(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    seqs: RecurrentBatch,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    chunk_size: int,
) -> Tensor:
    """``kernels.ssd.ssd`` in torch, in the form ``seqs.path`` allows."""
    path = seqs.path
    if path is Path.DECODE:
        return ssd_update_torch(x, dt, A, B, C, D, dt_bias, states, seqs.slot_ids, dt_softplus, dt_limit)
    if path is Path.VERIFY:
        assert seqs.state_dst_slots is not None
        return ssd_verify_torch(
            x,
            dt,
            A,
            B,
            C,
            D,
            dt_bias,
            states,
            seqs.slot_ids,
            seqs.state_dst_slots,
            seqs.uniform_len,
            dt_softplus,
            dt_limit,
        )
    return ssd_varlen_torch(
        x,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        states,
        seqs.cu_seqlens,
        seqs.slot_ids,
        seqs.has_initial_state,
        dt_softplus,
        dt_limit,
        chunk_size,
        seqs.state_dst_slots,
    )


def ssd_varlen_torch(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    cu_seqlens: Tensor,
    slot_ids: Tensor,
    has_initial_state: Tensor,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    chunk_size: int,
    state_dst_slots: Tensor | None,
) -> Tensor:
    check_shapes(x, dt, B, C, states)
    xf = x.float()
    step = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inputs = (xf, step, B.float(), C.float())
    a = A.float()
    scan_varlen(
        inputs,
        out,
        states,
        cu_seqlens,
        slot_ids,
        has_initial_state,
        state_dst_slots,
        partial(ssd_recurrent, A=a),
        partial(ssd_chunked, A=a, chunk_size=chunk_size),
        RECURRENT_MAX_LEN,
    )
    out = out + D.float()[:, None] * xf
    return out.to(x.dtype)


def _expand_groups(x: Tensor, num_heads: int, dim: int) -> Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H // G)."""
    rep = num_heads // x.shape[dim]
    return x if rep == 1 else x.repeat_interleave(rep, dim=dim)


def ssd_recurrent(
    inputs: tuple[Tensor, ...], valid: Tensor, s: Tensor, on_step: OnStep | None = None, *, A: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-token recurrence on padded rows (without the D skip); updates ``s`` in place.

    inputs: x [n, L, H, P]; dt' [n, L, H]; B, C [n, L, G, N]. valid [n, L]: padded steps get
    dt' = 0, which leaves S exactly unchanged. s [n, H, P, N] fp32 contiguous
    -> (y [n, L, H, P], S).
    """
    x, step, b, c = inputs
    step = torch.where(valid[..., None], step, 0.0)
    decay = (step * A).exp()  # [n, L, H]
    xdt = x * step[..., None]  # [n, L, H, P]
    outs = []
    for i in range(x.shape[1]):
        outs.append(ssd_step(xdt[:, i], decay[:, i], b[:, i], c[:, i], s))
        if on_step is not None:
            on_step(i, s)
    return torch.stack(outs, dim=1), s


def ssd_step(xdt: Tensor, decay: Tensor, b: Tensor, c: Tensor, s: Tensor) -> Tensor:
    """One token of n rows (without D), updating ``s`` in place: xdt = dt' x [n, H, P];
    decay = exp(dt' A) [n, H]; B, C [n, G, N]; s [n, H, P, N] fp32 contiguous -> y [n, H, P]."""
    n, num_heads, p_dim, n_dim = s.shape
    flat = s.view(n * num_heads, p_dim, n_dim)  # shares storage with s
    b = _expand_groups(b, num_heads, 1).reshape(n * num_heads, 1, n_dim)
    c = _expand_groups(c, num_heads, 1).reshape(n * num_heads, n_dim, 1)
    s.mul_(decay[:, :, None, None])
    flat.baddbmm_(xdt.reshape(n * num_heads, p_dim, 1), b)  # S += dt' x B^T
    return (flat @ c).view(n, num_heads, p_dim)  # S C


def ssd_update_torch(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    slot_ids: Tensor,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> Tensor:
    """One token per sequence, every initial state present: gather the live slots once, one
    ``ssd_step`` (the varlen recurrence's own step, so the results are bitwise equal), scatter."""
    check_shapes(x, dt, B, C, states)
    xf = x.float()
    step = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [B, H]
    slots = slot_ids.long()
    s = states[slots].float()  # a copy [B, H, P, N]
    y = ssd_step(xf * step[..., None], (step * A.float()).exp(), B.float(), C.float(), s)
    scatter_rows_(states, slots, s)
    return (y + D.float()[:, None] * xf).to(x.dtype)


def ssd_verify_torch(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    slot_ids: Tensor,
    state_dst_slots: Tensor,
    seq_len: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> Tensor:
    """B sequences of exactly ``seq_len`` tokens (sequence-major rows), every one with an
    initial state and a snapshot slot at every token: ``seq_len`` batched ``ssd_step``s, each
    followed by its snapshot write -- what the varlen path does for such a batch, without
    building its plan (bitwise equal; no host read, so it can be traced or captured)."""
    check_shapes(x, dt, B, C, states)
    num_seqs = slot_ids.shape[0]
    xf = x.float()
    step = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # [B*T, H]
    slots = slot_ids.long()
    s = states[slots].float()  # a copy [B, H, P, N]

    def rows(t: Tensor) -> Tensor:  # [B*T, ...] -> [B, T, ...]
        return t.reshape(num_seqs, seq_len, *t.shape[1:])

    step4, b4, c4 = rows(step), rows(B.float()), rows(C.float())
    decay, xdt = (step4 * A.float()).exp(), rows(xf) * step4[..., None]
    dst = state_dst_slots.long().view(num_seqs, seq_len)
    outs = []
    for t in range(seq_len):
        outs.append(ssd_step(xdt[:, t], decay[:, t], b4[:, t], c4[:, t], s))
        scatter_rows_(states, dst[:, t], s)
    scatter_rows_(states, slots, s)
    y = torch.stack(outs, dim=1).reshape(x.shape)
    return (y + D.float()[:, None] * xf).to(x.dtype)


def ssd_chunked(inputs: tuple[Tensor, ...], s: Tensor, *, A: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Chunked form of one segment (without D): x [L, H, P]; dt' [L, H]; B, C [L, G, N]."""
    x, step, b, c = inputs
    outs = []
    for c0 in range(0, x.shape[0], chunk_size):
        sl = slice(c0, c0 + chunk_size)
        y, s = _ssd_chunk(x[sl], step[sl], b[sl], c[sl], A, s)
        outs.append(y)
    return torch.cat(outs, dim=0), s


def _ssd_chunk(x: Tensor, step: Tensor, b: Tensor, c: Tensor, A: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of n tokens from state s [H, P, N] -> (y [n, H, P], state after the chunk).

    With a_i = sum_{m<=i} dt'_m A (log decay from chunk start through token i):
        y_i = exp(a_i) S0 C_i + sum_{j<=i} exp(a_i - a_j) (C_i.B_j) dt'_j x_j
        S_n = exp(a_n) S0 + sum_j exp(a_n - a_j) dt'_j x_j B_j^T
    """
    num_heads, n = x.shape[1], x.shape[0]
    b = _expand_groups(b, num_heads, 1).transpose(0, 1)  # [H, n, N]
    c = _expand_groups(c, num_heads, 1).transpose(0, 1)  # [H, n, N]
    xdt = (x * step[..., None]).transpose(0, 1)  # [H, n, P]
    log_a = (step * A).transpose(0, 1).cumsum(-1)  # [H, n]
    lower = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    decay = decay_exp((log_a[:, :, None] - log_a[:, None, :]).masked_fill(~lower, float("-inf")))
    y = ((c @ b.transpose(1, 2)) * decay) @ xdt  # [H, n, P]
    y = y + decay_exp(log_a)[..., None] * (c @ s.transpose(1, 2))  # S0 C_i: [H, n, P]
    to_end = decay_exp(log_a[:, -1:] - log_a)[..., None]  # [H, n, 1]
    s_new = decay_exp(log_a[:, -1])[:, None, None] * s + (xdt * to_end).transpose(1, 2) @ b
    return y.transpose(0, 1), s_new
