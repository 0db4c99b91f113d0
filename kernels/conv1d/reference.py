"""Depthwise causal conv1d, torch reference: the ground truth and CPU path.

Sequence b is convolved over ``initial W-1 inputs ++ x_b`` (the initial inputs come from
``conv_states[slot_ids[b]]`` when ``has_initial_state[b]``, else zeros). Afterwards the live
slot holds the last W-1 *pre-activation inputs*, oldest first; snapshot slots
(``state_dst_slots``) get the W-1 inputs ending at their token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import SeqPlan, make_plan
from kernels.recurrent_batch import Path, RecurrentBatch
from kernels.static import scatter_rows_


def check_shapes(x: Tensor, weight: Tensor, conv_states: Tensor, activation: str | None) -> None:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    d, w = weight.shape
    if x.shape[-1] != d or conv_states.shape[1:] != (d, w - 1):
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"conv_states {tuple(conv_states.shape)} (expected [S, {d}, {w - 1}])"
        )


def _apply_taps(
    taps: list[Tensor], weight: Tensor, bias: Tensor | None, activation: str | None, rows: Tensor | None = None
) -> Tensor:
    """sum_w taps[w] * weight[:, w] (+ bias), activated; taps[w] [N, D] fp32, newest last;
    ``rows``: only those rows of the sum are kept (before the bias and the activation).

    The one accumulation order shared by the varlen and update paths (bitwise equal results:
    the products and sums are exact per element wherever a row sits; the activation, whose
    vectorised and scalar forms differ in the last bit, runs on the kept rows alone).
    """
    cols = weight.float().unbind(1)  # W views [D]: one op
    acc = taps[0] * cols[0]
    for w in range(1, len(taps)):
        acc = acc + taps[w] * cols[w]
    if rows is not None:
        acc = acc[rows]
    if bias is not None:
        acc = acc + bias.float()
    return F.silu(acc) if activation is not None else acc


def causal_conv1d_torch(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor, seqs: RecurrentBatch, activation: str | None
) -> Tensor:
    """``kernels.conv1d.causal_conv1d`` in torch, in the form ``seqs.path`` allows."""
    path = seqs.path
    if path is Path.DECODE:
        return causal_conv1d_update_torch(x, weight, bias, conv_states, seqs.slot_ids, activation)
    if path is Path.VERIFY:
        assert seqs.state_dst_slots is not None
        return causal_conv1d_verify_torch(
            x, weight, bias, conv_states, seqs.slot_ids, seqs.state_dst_slots, seqs.uniform_len, activation
        )
    return causal_conv1d_varlen_torch(
        x,
        weight,
        bias,
        conv_states,
        seqs.cu_seqlens,
        seqs.slot_ids,
        seqs.has_initial_state,
        activation,
        seqs.state_dst_slots,
    )


def causal_conv1d_varlen_torch(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    cu_seqlens: Tensor,
    slot_ids: Tensor,
    has_initial_state: Tensor,
    activation: str | None,
    state_dst_slots: Tensor | None,
) -> Tensor:
    check_shapes(x, weight, conv_states, activation)
    plan = make_plan(cu_seqlens, state_dst_slots)
    num_seqs, width = len(plan.lens), weight.shape[1]
    hist = width - 1
    if x.shape[0] == 0 or num_seqs == 0:
        return x.new_empty(x.shape)
    ext, tok_rows = _extended_inputs(x, conv_states, cu_seqlens, slot_ids, has_initial_state, hist)
    # Every window of ext (row j: the W inputs ending at ext row j + W-1), from W contiguous
    # views, then the tokens' rows: one gather instead of W; the windows that straddle two
    # blocks are dropped. Elementwise, so each row equals the gathered taps' row bitwise.
    windows = ext.shape[0] - hist
    taps = [ext[w : w + windows] for w in range(width)]
    out = _apply_taps(taps, weight, bias, activation, rows=tok_rows - hist)
    _write_states(ext, tok_rows, conv_states, plan, slot_ids, hist)
    return out.to(x.dtype)


def _extended_inputs(
    x: Tensor, conv_states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor, hist: int
) -> tuple[Tensor, Tensor]:
    """Every sequence's W-1 initial inputs followed by its tokens, stacked: ext [T + B*(W-1), D].

    Sequence b's block starts at row ``cu[b] + b*(W-1)``; token t sits at row
    ``tok_rows[t] = t + (b+1)*(W-1)`` (int64 [T]).
    """
    num_seqs, num_tokens, dim = slot_ids.shape[0], x.shape[0], x.shape[1]
    device = x.device
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_of_tok = torch.repeat_interleave(torch.arange(num_seqs, device=device), lens)
    tok_rows = torch.arange(num_tokens, device=device) + (seq_of_tok + 1) * hist
    block_starts = cu_seqlens[:-1].long() + torch.arange(num_seqs, device=device) * hist
    init_rows = (block_starts[:, None] + torch.arange(hist, device=device)[None, :]).reshape(-1)
    init = conv_states[slot_ids.long()].float()  # [B, D, W-1]
    init = torch.where(has_initial_state.bool()[:, None, None], init, torch.zeros_like(init))
    ext = torch.empty(num_tokens + num_seqs * hist, dim, dtype=torch.float32, device=device)
    ext[tok_rows] = x.float()
    ext[init_rows] = init.transpose(1, 2).reshape(-1, dim)
    return ext, tok_rows


def _write_states(
    ext: Tensor, tok_rows: Tensor, conv_states: Tensor, plan: SeqPlan, slot_ids: Tensor, hist: int
) -> None:
    """Snapshot slots first, then the live slots, each taking the W-1 inputs ending at a token."""
    device = ext.device
    offsets = torch.arange(1 - hist, 1, device=device)  # oldest .. newest
    if plan.dst is not None:
        snap_toks = [t for t, d in enumerate(plan.dst) if d != 0]
        if snap_toks:
            toks = torch.tensor(snap_toks, device=device)
            dst = torch.tensor([plan.dst[t] for t in snap_toks], device=device)
            window = ext[tok_rows[toks][:, None] + offsets[None, :]]  # [n, W-1, D]
            conv_states[dst] = window.transpose(1, 2).to(conv_states.dtype)
    seqs = [b for b, n in enumerate(plan.lens) if n > 0]
    if seqs:
        last = torch.tensor([plan.starts[b] + plan.lens[b] - 1 for b in seqs], device=device)
        live = slot_ids.long()[torch.tensor(seqs, device=device)]
        window = ext[tok_rows[last][:, None] + offsets[None, :]]  # [n, W-1, D]
        conv_states[live] = window.transpose(1, 2).to(conv_states.dtype)


def causal_conv1d_update_torch(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor, slot_ids: Tensor, activation: str | None
) -> Tensor:
    check_shapes(x, weight, conv_states, activation)
    slots = slot_ids.long()
    window = torch.cat([conv_states[slots].float(), x.float()[:, :, None]], dim=2)  # [B, D, W]
    out = _apply_taps(list(window.unbind(2)), weight, bias, activation)
    scatter_rows_(conv_states, slots, window[:, :, 1:])
    return out.to(x.dtype)


def causal_conv1d_verify_torch(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    slot_ids: Tensor,
    state_dst_slots: Tensor,
    seq_len: int,
    activation: str | None,
) -> Tensor:
    """B sequences of exactly ``seq_len`` tokens each (x [B*T, D], sequence-major), every one
    with an initial state and a snapshot slot at every token: one padded-free window per
    sequence instead of a varlen plan; same taps, same order, so bitwise equal to varlen."""
    check_shapes(x, weight, conv_states, activation)
    num_seqs, width, dim = slot_ids.shape[0], weight.shape[1], x.shape[1]
    hist, slots = width - 1, slot_ids.long()
    window = torch.cat(
        [conv_states[slots].float(), x.float().view(num_seqs, seq_len, dim).transpose(1, 2)], dim=2
    )  # [B, D, W-1+T]
    taps = [window[:, :, w : w + seq_len].transpose(1, 2) for w in range(width)]  # [B, T, D]
    out = _apply_taps(taps, weight, bias, activation).reshape(num_seqs * seq_len, dim)
    after = window.unfold(2, hist, 1)[:, :, 1:, :]  # [B, D, T, W-1]: after token t
    dst = state_dst_slots.long().view(num_seqs, seq_len)
    scatter_rows_(conv_states, dst.reshape(-1), after.permute(0, 2, 1, 3).reshape(-1, dim, hist))
    scatter_rows_(conv_states, slots, window[:, :, seq_len:])
    return out.to(x.dtype)
