"""RG-LRU (RecurrentGemma / Griffin), torch reference: the ground truth and the CPU path.

C channels (``lru_width``), one fp32 state value per channel and slot. Per token t, with
the gate logits ``gx``, ``ga`` [C] (the block-diagonal gate projections, computed outside)
and ``c = -8 softplus(recurrent_param)`` [C]:

    log a_t = c * sigmoid(ga_t)                        (a_t in (0, 1])
    u_t     = x_t * sigmoid(gx_t) * sqrt(1 - a_t^2)    (at position 0: no sqrt factor)
    h_t     = a_t * h_{t-1} + u_t                      (at position 0: h_t = u_t)
    y_t     = h_t

``rglru_inputs`` computes (a, u) pointwise; the scan is a diagonal linear recurrence,
run per token for short sequences and, for long ones, as an inclusive associative scan
within chunks (the pairs (a, u) compose as (a a', a' u + u'); products of a stay in
[0, 1], so it is as stable as the loop). Position 0 is transformers' document reset: the
state before it is ignored whatever the slot holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import OnStep, scan_varlen
from kernels.recurrent_batch import Path, RecurrentBatch

# Segments of at most this many tokens take the per-token recurrence; longer ones are chunked.
RECURRENT_MAX_LEN = 16
CHUNK_SIZE = 64


def rglru_inputs(x: Tensor, gx: Tensor, ga: Tensor, log_a_scale: Tensor, reset: Tensor) -> tuple[Tensor, Tensor]:
    """x, gx, ga [T, C]; log_a_scale [C] (= -8 softplus(recurrent_param)); reset bool [T]
    -> (a, u) [T, C] fp32: the decay and the normalised input of each token."""
    log_a = log_a_scale.float() * torch.sigmoid(ga.float())
    a = torch.exp(log_a)
    keep = ~reset[:, None]
    scale = torch.where(keep, torch.sqrt(1.0 - torch.exp(2.0 * log_a)), 1.0)
    u = x.float() * torch.sigmoid(gx.float()) * scale
    return a * keep, u


def rglru_torch(
    x: Tensor, gx: Tensor, ga: Tensor, log_a_scale: Tensor, reset: Tensor, states: Tensor, seqs: RecurrentBatch
) -> Tensor:
    """``kernels.rglru.rg_lru`` in torch: the one-step form on a decode, the varlen form otherwise."""
    check_shapes(x, gx, ga, log_a_scale, states)
    a, u = rglru_inputs(x, gx, ga, log_a_scale, reset)
    if seqs.path is Path.DECODE:
        slots = seqs.slot_ids.long()
        h = a * states[slots].float() + u
        states[slots] = h.to(states.dtype)
        return h.to(x.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    scan_varlen(
        (a, u),
        out,
        states,
        seqs.cu_seqlens,
        seqs.slot_ids,
        seqs.has_initial_state,
        seqs.state_dst_slots,
        scan_recurrent,
        scan_chunked,
        RECURRENT_MAX_LEN,
    )
    return out.to(x.dtype)


def check_shapes(x: Tensor, gx: Tensor, ga: Tensor, log_a_scale: Tensor, states: Tensor) -> None:
    channels = x.shape[-1]
    if (
        gx.shape != x.shape
        or ga.shape != x.shape
        or log_a_scale.shape != (channels,)
        or states.shape[1:] != (channels,)
    ):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, gx {tuple(gx.shape)}, ga {tuple(ga.shape)}, "
            f"log_a_scale {tuple(log_a_scale.shape)}, states {tuple(states.shape)} (expected [S, C])"
        )


def scan_recurrent(
    inputs: tuple[Tensor, ...], valid: Tensor, s: Tensor, on_step: OnStep | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token recurrence on padded rows: a, u [n, L, C]; valid [n, L] (padded steps keep
    the state: a = 1, u = 0); s [n, C] fp32, updated in place -> (h [n, L, C], s)."""
    a, u = inputs
    a = torch.where(valid[..., None], a, 1.0)
    u = torch.where(valid[..., None], u, 0.0)
    outs = []
    for i in range(a.shape[1]):
        s.mul_(a[:, i]).add_(u[:, i])
        outs.append(s.clone())
        if on_step is not None:
            on_step(i, s)
    return torch.stack(outs, dim=1), s


def scan_chunked(inputs: tuple[Tensor, ...], s: Tensor) -> tuple[Tensor, Tensor]:
    """One segment a, u [L, C] from s [C] -> (h [L, C], the state after it)."""
    a, u = inputs
    outs = []
    for c0 in range(0, a.shape[0], CHUNK_SIZE):
        h = _scan_chunk(a[c0 : c0 + CHUNK_SIZE], u[c0 : c0 + CHUNK_SIZE], s)
        outs.append(h)
        s = h[-1]
    return torch.cat(outs, dim=0), s


def _scan_chunk(a: Tensor, u: Tensor, s: Tensor) -> Tensor:
    """Inclusive associative scan (log2(n) doubling steps): every h_i = A_i s + U_i."""
    acc_a, acc_u = a, u
    offset = 1
    while offset < a.shape[0]:
        acc_u = torch.cat([acc_u[:offset], acc_a[offset:] * acc_u[:-offset] + acc_u[offset:]])
        acc_a = torch.cat([acc_a[:offset], acc_a[offset:] * acc_a[:-offset]])
        offset *= 2
    return acc_a * s + acc_u


def softplus_scale(recurrent_param: Tensor) -> Tensor:
    """``-8 softplus(recurrent_param)`` [C] fp32: the log decay at a fully open gate."""
    return -8.0 * F.softplus(recurrent_param.float())
