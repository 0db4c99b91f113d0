"""Gated DeltaNet (Qwen3-Next linear attention), torch reference: the ground truth and CPU path.

Per value head, with state S [K, V] (HF/FLA layout), q/k l2-normalised over K and q scaled:

    S'    = exp(g_t) * S_{t-1}                  (decay; g_t <= 0 is a log decay)
    u_t   = beta_t * (v_t - S'^T k_t)           (delta rule: write only what S' mispredicts)
    S_t   = S' + k_t u_t^T
    o_t   = S_t^T q_t

q/k may have fewer heads than v (Hk divides Hv): key head j serves value heads
``j*r .. j*r + r-1`` with r = Hv / Hk, as ``repeat_interleave`` in transformers.

Two algorithms, chosen per segment by length, give the same result: a per-token recurrence
(decode, speculative verify, short chunks) and a chunked WY form (long prefill segments).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from kernels import OnStep, run_chunks, scan_varlen
from kernels.decay import decay_exp
from kernels.recurrent_batch import Path, RecurrentBatch
from kernels.static import scatter_rows_

# Segments of at most this many tokens take the per-token recurrence; longer ones are chunked.
RECURRENT_MAX_LEN = 16
L2NORM_EPS = 1e-6  # x * rsqrt(sum(x^2) + eps), as FLA and transformers


def l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def check_shapes(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor) -> None:
    num_tokens, num_heads, v_dim = v.shape
    k_heads, k_dim = k.shape[1], k.shape[2]
    ok = (
        q.shape == k.shape
        and k.shape[0] == num_tokens
        and num_heads % k_heads == 0
        and g.shape == (num_tokens, num_heads)
        and beta.shape == g.shape
        and states.shape[1:] == (num_heads, k_dim, v_dim)
    )
    if not ok:
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}, "
            f"states {tuple(states.shape)}"
        )


def delta_rule_torch(
    update: Callable[..., Tensor],
    verify: Callable[..., Tensor],
    varlen: Callable[..., Tensor],
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
    """A delta-rule op (GDN, KDA) in torch, in the form ``seqs.path`` allows: its reference's
    ``update`` (decode), ``verify`` or ``varlen`` form."""
    path = seqs.path
    if path is Path.DECODE:
        return update(q, k, v, g, beta, states, seqs.slot_ids, scale, use_qk_l2norm)
    if path is Path.VERIFY:
        return verify(
            q, k, v, g, beta, states, seqs.slot_ids, seqs.state_dst_slots, seqs.uniform_len, scale, use_qk_l2norm
        )
    return varlen(
        q,
        k,
        v,
        g,
        beta,
        states,
        seqs.cu_seqlens,
        seqs.slot_ids,
        seqs.has_initial_state,
        scale,
        use_qk_l2norm,
        chunk_size,
        seqs.state_dst_slots,
    )


def gated_delta_rule_varlen_torch(
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
        gdn_recurrent,
        partial(gdn_chunked, chunk_size=chunk_size),
        RECURRENT_MAX_LEN,
    )
    return out.to(v.dtype)


def gated_delta_rule_update_torch(
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
    """One token per sequence, every initial state present: gather the live slots once, one
    ``gdn_step`` (the varlen recurrence's own step, so the results are bitwise equal), scatter."""
    check_shapes(q, k, v, g, beta, states)
    qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    num_heads = v.shape[1]
    slots = slot_ids.long()
    s = states[slots].float()  # a copy [B, H, K, V]
    o = gdn_step(
        _expand_heads(qf, num_heads, 1), _expand_heads(kf, num_heads, 1), v.float(), g.float().exp(), beta.float(), s
    )
    scatter_rows_(states, slots, s)
    return o.to(v.dtype)


def gated_delta_rule_verify_torch(
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
    """B sequences of exactly ``seq_len`` tokens (sequence-major rows), every one with an
    initial state and a snapshot slot at every token: ``seq_len`` batched ``gdn_step``s,
    each followed by its snapshot write -- what the varlen path does for such a batch,
    without building its plan (bitwise equal)."""
    check_shapes(q, k, v, g, beta, states)
    qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    num_seqs, num_heads = slot_ids.shape[0], v.shape[1]
    slots = slot_ids.long()
    s = states[slots].float()  # a copy [B, H, K, V]

    def rows(x: Tensor) -> Tensor:  # [B*T, ...] -> [B, T, ...]
        return x.reshape(num_seqs, seq_len, *x.shape[1:])

    q4, k4 = rows(_expand_heads(qf, num_heads, 1)), rows(_expand_heads(kf, num_heads, 1))
    v4, decay, b4 = rows(v.float()), rows(g.float().exp()), rows(beta.float())
    dst = state_dst_slots.long().view(num_seqs, seq_len)
    outs = []
    for t in range(seq_len):
        outs.append(gdn_step(q4[:, t], k4[:, t], v4[:, t], decay[:, t], b4[:, t], s))
        scatter_rows_(states, dst[:, t], s)
    scatter_rows_(states, slots, s)
    return torch.stack(outs, dim=1).reshape(v.shape).to(v.dtype)


def normalized_qk(q: Tensor, k: Tensor, scale: float | None, use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    """fp32 q, k; l2-normalised over K when asked; q times ``scale`` (default K**-0.5)."""
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    return qf * (scale if scale is not None else q.shape[-1] ** -0.5), kf


def _expand_heads(x: Tensor, num_heads: int, dim: int) -> Tensor:
    """Repeat key heads so each value head has its own copy (no-op when counts match)."""
    rep = num_heads // x.shape[dim]
    return x if rep == 1 else x.repeat_interleave(rep, dim=dim)


def gdn_recurrent(
    inputs: tuple[Tensor, ...], valid: Tensor, s: Tensor, on_step: OnStep | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token recurrence on padded rows; updates ``s`` in place and returns it.

    inputs: q, k [n, L, Hk, K] (normalised, scaled); v [n, L, H, V]; g, beta [n, L, H].
    valid [n, L]: padded steps get g = beta = 0, which leaves S exactly unchanged.
    s [n, H, K, V] fp32 contiguous -> (o [n, L, H, V], S [n, H, K, V]).
    """
    q, k, v, g, beta = inputs
    num_steps, num_heads = v.shape[1], v.shape[2]
    decay = torch.where(valid[..., None], g, 0.0).exp()  # [n, L, H]
    beta = torch.where(valid[..., None], beta, 0.0)
    q, k = _expand_heads(q, num_heads, 2), _expand_heads(k, num_heads, 2)
    outs = []
    for i in range(num_steps):
        outs.append(gdn_step(q[:, i], k[:, i], v[:, i], decay[:, i], beta[:, i], s))
        if on_step is not None:
            on_step(i, s)
    return torch.stack(outs, dim=1), s


def gdn_step(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor, s: Tensor) -> Tensor:
    """One token of n rows, updating ``s`` in place: q, k [n, H, K] (H value heads);
    v [n, H, V]; decay = exp(g), beta [n, H]; s [n, H, K, V] fp32 contiguous -> o [n, H, V]."""
    s.mul_(decay[:, :, None, None])
    return delta_rule_step(q, k, v, beta, s)


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, s: Tensor) -> Tensor:
    """The delta-rule write and read of one token, on an already decayed ``s`` (in place):
    u = beta (v - S^T k); S += k u^T; -> o = S^T q. Shapes as ``gdn_step``; shared with KDA,
    whose decay is per key channel."""
    n, num_heads, k_dim, v_dim = s.shape
    flat = s.view(n * num_heads, k_dim, v_dim)  # shares storage with s
    k = k.reshape(n * num_heads, k_dim, 1)
    predicted = (k.transpose(1, 2) @ flat).view(n, num_heads, v_dim)  # S^T k
    u = beta[:, :, None] * (v - predicted)  # [n, H, V]
    flat.baddbmm_(k, u.reshape(n * num_heads, 1, v_dim))  # S += k u^T
    return (q.reshape(n * num_heads, 1, k_dim) @ flat).view(n, num_heads, v_dim)  # S^T q


def gdn_chunked(inputs: tuple[Tensor, ...], s: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Chunked form of one segment: q, k [L, Hk, K]; v [L, H, V]; g, beta [L, H]; s [H, K, V]."""
    return run_chunks(_gdn_chunk, inputs, s, chunk_size)


def _gdn_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of c tokens from state s [H, K, V] -> (o [c, H, V], state after the chunk).

    With b_i = exp(sum_{m<=i} g_m) (decay from chunk start through token i), unrolling gives
        u_i = beta_i v_i - beta_i b_i S0^T k_i - sum_{j<i} beta_i (b_i/b_j) (k_i.k_j) u_j,
    i.e. (I + A) U = beta*V - (beta*b*K) S0 with A strictly lower triangular: two unit
    triangular solves. Then o_i = b_i S0^T q_i + sum_{j<=i} (b_i/b_j) (q_i.k_j) u_j and
    S_c = b_c S0 + sum_j (b_c/b_j) k_j u_j^T.
    """
    num_heads, c = v.shape[1], v.shape[0]
    q, k = _expand_heads(q, num_heads, 1), _expand_heads(k, num_heads, 1)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, c, *]
    log_b = g.transpose(0, 1).cumsum(-1)  # [H, c]
    beta = beta.transpose(0, 1)[..., None]  # [H, c, 1]
    lower = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
    # decay[h, i, j] = b_i / b_j for j <= i, else 0 (masked before exp: no overflow)
    decay = decay_exp((log_b[:, :, None] - log_b[:, None, :]).masked_fill(~lower, float("-inf")))
    a = (beta * (k @ k.transpose(1, 2)) * decay).tril(-1)
    system = a + torch.eye(c, dtype=a.dtype, device=a.device)
    b = decay_exp(log_b)[..., None]  # b_i  [H, c, 1]
    w_v = torch.linalg.solve_triangular(system, beta * v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, beta * b * k, upper=False, unitriangular=True)
    u = w_v - w_k @ s  # [H, c, V]
    o = b * (q @ s) + ((q @ k.transpose(1, 2)) * decay) @ u
    to_end = decay_exp(log_b[:, -1:] - log_b)[..., None]  # b_c / b_j  [H, c, 1]
    s_new = decay_exp(log_b[:, -1])[:, None, None] * s + (k * to_end).transpose(1, 2) @ u
    return o.transpose(0, 1), s_new


def gated_delta_rule_torch(
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
    """``kernels.gdn.gated_delta_rule`` in torch."""
    return delta_rule_torch(
        gated_delta_rule_update_torch,
        gated_delta_rule_verify_torch,
        gated_delta_rule_varlen_torch,
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
