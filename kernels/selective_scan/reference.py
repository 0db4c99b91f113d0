"""Mamba1 selective scan (Jamba), torch reference: the ground truth and the CPU path.

H channels (Mamba1's d_inner; each channel is its own SSM, an SSD head with P = 1), state
S [H, N] per slot, B and C [N] per token shared by every channel, or [G, N] per token where
the channels form G groups of H / G (Zamba's independent Mamba heads: group g's B and C feed
channels g H / G .. (g + 1) H / G - 1):

    dt'_t = softplus(dt_t + dt_bias)                  (softplus only if dt_softplus)
    S_t   = exp(dt'_t[:, None] * A) * S_{t-1} + (dt'_t * x_t)[:, None] * B_t[None, :]
    y_t   = S_t C_t + D * x_t

A [H, N] is the negative decay rate per channel and state (``-exp(A_log)``): unlike SSD's one
scalar per head, every state column decays at its own rate, so the chunked path is an
inclusive associative scan of (decay, input) pairs within a chunk, not SSD's segment sums.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import OnStep, scan_varlen
from kernels.recurrent_batch import Path, RecurrentBatch

# Segments of at most this many tokens take the per-token recurrence; longer ones are chunked.
RECURRENT_MAX_LEN = 16


def discretize_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool) -> Tensor:
    """The one dt rule of every path: [T, H] raw -> [T, H] fp32 step sizes."""
    dt = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def num_groups(B: Tensor) -> int:
    """B or C [T, N] (one group) or [T, G, N]."""
    return 1 if B.dim() == 2 else B.shape[1]


def grouped(t: Tensor) -> Tensor:
    """B or C as [T, G, N] (a view)."""
    return t.unsqueeze(1) if t.dim() == 2 else t


def check_shapes(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, states: Tensor) -> None:
    num_tokens, num_channels = x.shape
    state_dim = A.shape[-1]
    groups = num_groups(B)
    ok = (
        dt.shape == x.shape
        and A.shape == (num_channels, state_dim)
        and B.dim() in (2, 3)
        and num_channels % groups == 0
        and grouped(B).shape == (num_tokens, groups, state_dim)
        and C.shape == B.shape
        and states.shape[1:] == (num_channels, state_dim)
    )
    if not ok:
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, dt {tuple(dt.shape)}, "
            f"A {tuple(A.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)}, "
            f"states {tuple(states.shape)} (expected [S, H, N]; B, C [T, N] or [T, G, N], G dividing H)"
        )


def _skip(out: Tensor, xf: Tensor, D: Tensor | None) -> Tensor:
    return out if D is None else out + D.float() * xf


def mamba_selective_scan_torch(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    states: Tensor,
    seqs: RecurrentBatch,
    dt_softplus: bool,
    chunk_size: int,
) -> Tensor:
    """``kernels.selective_scan.mamba_selective_scan`` in torch: the one-step form on a
    decode, the varlen form otherwise (it has no verify form)."""
    if seqs.path is Path.DECODE:
        return selective_scan_update_torch(x, dt, A, B, C, D, dt_bias, states, seqs.slot_ids, dt_softplus)
    return selective_scan_varlen_torch(
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
        chunk_size,
        seqs.state_dst_slots,
    )


def selective_scan_varlen_torch(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    states: Tensor,
    cu_seqlens: Tensor,
    slot_ids: Tensor,
    has_initial_state: Tensor,
    dt_softplus: bool,
    chunk_size: int,
    state_dst_slots: Tensor | None,
) -> Tensor:
    check_shapes(x, dt, A, B, C, states)
    xf = x.float()
    step = discretize_dt(dt, dt_bias, dt_softplus)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    a = A.float()
    scan_varlen(
        (xf, step, grouped(B).float(), grouped(C).float()),
        out,
        states,
        cu_seqlens,
        slot_ids,
        has_initial_state,
        state_dst_slots,
        partial(scan_recurrent, A=a),
        partial(scan_chunked, A=a, chunk_size=chunk_size),
        RECURRENT_MAX_LEN,
    )
    return _skip(out, xf, D).to(x.dtype)


def scan_step(xdt: Tensor, decay: Tensor, b: Tensor, c: Tensor, s: Tensor) -> Tensor:
    """One token of n rows (without D), updating ``s`` in place: xdt = dt' x [n, H];
    decay = exp(dt' A) [n, H, N]; B, C [n, G, N]; s [n, H, N] fp32 (contiguous) -> y [n, H]."""
    n, h, d = s.shape
    g = b.shape[1]
    sg = s.view(n, g, h // g, d)
    sg.mul_(decay.reshape(sg.shape)).addcmul_(xdt.reshape(n, g, h // g, 1), b[:, :, None, :])
    # a product and a last-dim sum, not bmm: bmm's sums change with n, this row's do not
    return (sg * c[:, :, None, :]).sum(dim=-1).view(n, h)


def scan_recurrent(
    inputs: tuple[Tensor, ...], valid: Tensor, s: Tensor, on_step: OnStep | None = None, *, A: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-token recurrence on padded rows (without the D skip); updates ``s`` in place.

    inputs: x, dt' [n, L, H]; B, C [n, L, G, N]. valid [n, L]: padded steps get dt' = 0, which
    leaves S exactly unchanged (decay 1, input 0). s [n, H, N] fp32 -> (y [n, L, H], S).
    """
    x, step, b, c = inputs
    step = torch.where(valid[..., None], step, 0.0)
    decay = (step[..., None] * A).exp()  # [n, L, H, N]
    xdt = x * step
    outs = []
    for i in range(x.shape[1]):
        outs.append(scan_step(xdt[:, i], decay[:, i], b[:, i], c[:, i], s))
        if on_step is not None:
            on_step(i, s)
    return torch.stack(outs, dim=1), s


def scan_chunked(inputs: tuple[Tensor, ...], s: Tensor, *, A: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Chunked form of one segment (without D): x, dt' [L, H]; B, C [L, G, N]; s [H, N]."""
    x, step, b, c = inputs
    outs = []
    for c0 in range(0, x.shape[0], chunk_size):
        sl = slice(c0, c0 + chunk_size)
        y, s = _scan_chunk(x[sl], step[sl], b[sl], c[sl], A, s)
        outs.append(y)
    return torch.cat(outs, dim=0), s


def _scan_chunk(x: Tensor, step: Tensor, b: Tensor, c: Tensor, A: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of n tokens from state s [H, N] (B, C [n, G, N]) -> (y [n, H], state after it).

    S_i = a_i S_{i-1} + u_i with a_i = exp(dt'_i A), u_i = dt'_i x_i B_i^T, all [H, N]. The
    pairs compose associatively, (a, u) then (a', u') = (a a', a' u + u'), so an inclusive
    scan (log2(n) doubling steps) gives every S_i = acc_a_i S_0 + acc_u_i at once; products
    of decays stay in (0, 1], so the form is as stable as the recurrence.
    """
    n, h = x.shape
    g = b.shape[1]
    acc_a = (step[:, :, None] * A).exp()  # [n, H, N]
    acc_u = ((x * step).view(n, g, h // g, 1) * b[:, :, None, :]).view(n, h, -1)  # [n, H, N]
    offset = 1
    while offset < x.shape[0]:
        prev_a, prev_u = acc_a[:-offset], acc_u[:-offset]
        acc_u = torch.cat([acc_u[:offset], acc_a[offset:] * prev_u + acc_u[offset:]])
        acc_a = torch.cat([acc_a[:offset], acc_a[offset:] * prev_a])
        offset *= 2
    states = acc_a * s + acc_u  # S_i: [n, H, N]
    y = torch.einsum("tgpn,tgn->tgp", states.view(n, g, h // g, -1), c).reshape(n, h)
    return y, states[-1]


def selective_scan_update_torch(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    states: Tensor,
    slot_ids: Tensor,
    dt_softplus: bool,
) -> Tensor:
    """One token per sequence, every initial state present: gather the live slots once, one
    ``scan_step`` (the varlen recurrence's own step, so the results are bitwise equal), scatter."""
    check_shapes(x, dt, A, B, C, states)
    xf = x.float()
    step = discretize_dt(dt, dt_bias, dt_softplus)  # [B, H]
    slots = slot_ids.long()
    s = states[slots].float()  # a copy [B, H, N]
    y = scan_step(xf * step, (step[..., None] * A.float()).exp(), grouped(B).float(), grouped(C).float(), s)
    states[slots] = s.to(states.dtype)
    return _skip(y, xf, D).to(x.dtype)
