"""Kimi Delta Attention (Kimi-Linear, BailingHybrid), torch reference: the ground truth and
the CPU path.

KDA is Gated DeltaNet with a decay per key *channel* instead of per head. Per head, with state
S [K, V] (the FLA / transformers layout), q and k l2-normalised over K and q scaled:

    S'    = diag(exp(g_t)) S_{t-1}              (g_t [K] <= 0: a log decay per key channel)
    u_t   = beta_t (v_t - S'^T k_t)             (delta rule)
    S_t   = S' + k_t u_t^T
    o_t   = S_t^T q_t

q, k and v have the same number of heads (no grouped heads in either family). Two
algorithms, chosen per segment by length by ``kernels.scan_varlen``, give the same result: a
per-token recurrence (decode, speculative verify, short chunks) and a chunked form
(``_kda_chunk``) for long prefill segments.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from kernels import OnStep, run_chunks, scan_varlen
from kernels.decay import decay_exp
from kernels.gdn.reference import delta_rule_step, delta_rule_torch, normalized_qk
from kernels.recurrent_batch import RecurrentBatch

# Segments of at most this many tokens take the per-token recurrence; longer ones are chunked.
RECURRENT_MAX_LEN = 16
# The chunked form holds a [H, c, c, K] decay tensor per chunk: keep c moderate.
DEFAULT_CHUNK = 32


def check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor) -> None:
    num_tokens, num_heads, v_dim = v.shape
    k_dim = k.shape[2]
    ok = (
        q.shape == k.shape == g.shape == (num_tokens, num_heads, k_dim)
        and beta.shape == (num_tokens, num_heads)
        and states.shape[1:] == (num_heads, k_dim, v_dim)
    )
    if not ok:
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}, "
            f"states {tuple(states.shape)}"
        )


def kda_varlen_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    cu_seqlens: Tensor,
    slot_ids: Tensor,
    has_initial_state: Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
    chunk_size: int,
    state_dst_slots: Tensor | None,
) -> Tensor:
    check_shapes(q, k, v, g, beta, states)
    qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    inputs = (qf, kf, v.float(), g.float(), beta.float())
    scan_varlen(
        inputs,
        out,
        states,
        cu_seqlens,
        slot_ids,
        has_initial_state,
        state_dst_slots,
        kda_recurrent,
        partial(kda_chunked, chunk_size=chunk_size),
        RECURRENT_MAX_LEN,
    )
    return out.to(v.dtype)


def kda_update_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    slot_ids: Tensor,
    scale: float | None,
    use_qk_l2norm: bool,
) -> Tensor:
    """One token per sequence, every initial state present: one ``kda_step`` on the gathered
    live slots (the varlen recurrence's own step: bitwise equal), scattered back."""
    check_shapes(q, k, v, g, beta, states)
    qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    slots = slot_ids.long()
    s = states[slots].float()  # a copy [B, H, K, V]
    o = kda_step(qf, kf, v.float(), g.float().exp(), beta.float(), s)
    states[slots] = s.to(states.dtype)
    return o.to(v.dtype)


def kda_verify_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    slot_ids: Tensor,
    state_dst_slots: Tensor,
    seq_len: int,
    scale: float | None,
    use_qk_l2norm: bool,
) -> Tensor:
    """B sequences of exactly ``seq_len`` tokens (sequence-major rows), each with an initial
    state and a snapshot slot at every token: ``seq_len`` batched ``kda_step``s, each followed
    by its snapshot write (what the varlen path does for such a batch, without its plan)."""
    check_shapes(q, k, v, g, beta, states)
    qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    num_seqs = slot_ids.shape[0]
    slots = slot_ids.long()
    s = states[slots].float()  # a copy [B, H, K, V]

    def rows(x: Tensor) -> Tensor:  # [B*T, ...] -> [B, T, ...]
        return x.reshape(num_seqs, seq_len, *x.shape[1:])

    q4, k4, v4, decay, b4 = rows(qf), rows(kf), rows(v.float()), rows(g.float().exp()), rows(beta.float())
    dst = state_dst_slots.long().view(num_seqs, seq_len)
    outs = []
    for t in range(seq_len):
        outs.append(kda_step(q4[:, t], k4[:, t], v4[:, t], decay[:, t], b4[:, t], s))
        states[dst[:, t]] = s.to(states.dtype)
    states[slots] = s.to(states.dtype)
    return torch.stack(outs, dim=1).reshape(v.shape).to(v.dtype)


def kda_step(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor, s: Tensor) -> Tensor:
    """One token of n rows, updating ``s`` in place: q, k, decay = exp(g) [n, H, K];
    v [n, H, V]; beta [n, H]; s [n, H, K, V] fp32 contiguous -> o [n, H, V]."""
    s.mul_(decay[..., None])
    return delta_rule_step(q, k, v, beta, s)


def kda_recurrent(
    inputs: tuple[Tensor, ...], valid: Tensor, s: Tensor, on_step: OnStep | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token recurrence on padded rows; updates ``s`` in place and returns it.

    inputs: q, k, g [n, L, H, K] (q, k normalised, q scaled); v [n, L, H, V]; beta [n, L, H].
    valid [n, L]: padded steps get g = beta = 0, which leaves S exactly unchanged.
    """
    q, k, v, g, beta = inputs
    decay = torch.where(valid[..., None, None], g, 0.0).exp()  # [n, L, H, K]
    beta = torch.where(valid[..., None], beta, 0.0)
    outs = []
    for i in range(v.shape[1]):
        outs.append(kda_step(q[:, i], k[:, i], v[:, i], decay[:, i], beta[:, i], s))
        if on_step is not None:
            on_step(i, s)
    return torch.stack(outs, dim=1), s


def kda_chunked(inputs: tuple[Tensor, ...], s: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Chunked form of one segment: q, k, g [L, H, K]; v [L, H, V]; beta [L, H]; s [H, K, V]."""
    return run_chunks(_kda_chunk, inputs, s, chunk_size)


def _kda_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of c tokens from state s [H, K, V] -> (o [c, H, V], state after the chunk).

    With b_i = sum_{m<=i} g_m [K] (log decay from chunk start through token i, per channel)
    and <x, y>_ij = sum_d x_i[d] y_j[d] exp(b_i[d] - b_j[d]) (j <= i: every factor <= 1),
    unrolling the recurrence gives
        (I + A) U = beta V - beta (K * exp(B)) S0,   A_ij = beta_i <k, k>_ij  (j < i),
        o_i = (q_i * exp(b_i))^T S0 + sum_{j<=i} <q, k>_ij u_j,
        S_c = exp(b_c) * S0 + sum_j (k_j * exp(b_c - b_j)) u_j^T.
    The decays are differences masked before the exp, so nothing overflows however small g.
    """
    c = v.shape[0]
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))  # [H, c, *]
    log_b = g.cumsum(1)  # [H, c, K]
    beta = beta.transpose(0, 1)[..., None]  # [H, c, 1]
    lower = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
    diff = log_b[:, :, None, :] - log_b[:, None, :, :]  # [H, c, c, K]: b_i - b_j
    decay = decay_exp(diff.masked_fill(~lower[None, :, :, None], float("-inf")))
    a = (beta * torch.einsum("hid,hjd,hijd->hij", k, k, decay)).tril(-1)
    system = a + torch.eye(c, dtype=a.dtype, device=a.device)
    w_v = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)
    b = decay_exp(log_b)  # [H, c, K]
    w_k = torch.linalg.solve_triangular(system, beta * (k * b), upper=False, unitriangular=True)
    u = w_v - w_k @ s  # [H, c, V]
    qk = torch.einsum("hid,hjd,hijd->hij", q, k, decay)  # lower incl. diagonal
    o = (q * b) @ s + qk @ u
    to_end = decay_exp(log_b[:, -1:, :] - log_b)  # [H, c, K]
    s_new = decay_exp(log_b[:, -1, :, None]) * s + (k * to_end).transpose(1, 2) @ u
    return o.transpose(0, 1), s_new


def kda_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    seqs: RecurrentBatch,
    scale: float | None,
    use_qk_l2norm: bool,
    chunk_size: int,
) -> Tensor:
    """``kernels.kda.kimi_delta_attention`` in torch."""
    return delta_rule_torch(
        kda_update_torch,
        kda_verify_torch,
        kda_varlen_torch,
        q,
        k,
        v,
        g,
        beta,
        states,
        seqs,
        scale,
        use_qk_l2norm,
        chunk_size,
    )
