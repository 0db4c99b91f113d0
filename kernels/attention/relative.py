"""Causal paged attention with a learned, query-conditioned relative-position bias (torch).

The score of query t (absolute position p) and context key at position j adds
``bias[t, h, p - j] = rel[t, h, :] @ proj[:, p - j]`` for distances ``0 <= p - j < E``
(``proj`` [R, E]: a bank of R bias-vs-distance profiles, ``rel`` [T, H, R]: each token's mix
of them) and nothing beyond E; Inkling's attention layers, whose only positional signal it
is. Everything else is ``kernels.attention``'s contract: the new k / v are written into the
pools at ``out_loc`` first, GQA, an optional sliding ``window``. Optional ``sinks`` [T, Hq]
(Inkling2): one more logit per query and head whose value is zero, so it only takes its share
of the softmax's mass (computed as a zero key / value whose mask entry is the sink).

Eager steps take the reference's plan (one padded SDPA call for the decodes, one per
prefill, with the bias as a float mask); a traced step (a compiled decode / verify of
uniform rows) reads every page of the table with no host read, as ``attend_uniform``. A
Triton kernel is not written yet: both paths are torch, on GPU too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import dense
from kernels.attention.reference import _Group, _plan, _plans, check_heads, check_window, write_kv
from kernels.static import tracing

__all__ = ["paged_attention_relative"]


def paged_attention_relative(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    out_loc: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
    rel: Tensor,
    proj: Tensor,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """``kernels.attention.paged_attention`` plus the bias of ``rel`` [T, Hq, R] through
    ``proj`` [R, E] and the ``sinks`` [T, Hq] (see the module docstring) -> [T, Hq, Dv]."""
    check_heads(q, k)
    check_window(window)
    write_kv(k, v, k_pool, v_pool, out_loc)
    if tracing():
        return _attend_uniform(q, k_pool, v_pool, page_table, seq_lens, page_size, scale, rel, proj, window, sinks)
    alone = dense.invariant()
    groups = _plans.get(
        (page_table, cu_seqlens, seq_lens),
        (page_size, window, alone),
        lambda: _plan(page_table, cu_seqlens, seq_lens, page_size, window, alone),
    )
    out = q.new_zeros(q.shape[0], q.shape[1], v_pool.shape[-1])
    for group in groups:
        _attend(q, k_pool, v_pool, group, scale, rel, proj, out, sinks)
    return out


def _bias(rel: Tensor, proj: Tensor, distance: Tensor) -> Tensor:
    """rel [..., H, R], distance [..., L] (the same leading dims) -> [..., H, L]."""
    logits = rel.float() @ proj.float()  # [..., H, E]
    extent = proj.shape[-1]
    index = distance.clamp(0, extent - 1)[..., None, :].expand(*logits.shape[:-1], distance.shape[-1])
    bias = logits.gather(-1, index)
    outside = ((distance < 0) | (distance >= extent))[..., None, :]
    return bias.masked_fill(outside, 0.0)


def _attend(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    g: _Group,
    scale: float,
    rel: Tensor,
    proj: Tensor,
    out: Tensor,
    sinks: Tensor | None,
) -> None:
    """One planned group: SDPA with the bias (and -inf where the plan masks) as a float mask;
    a sink is one more zero key / value whose mask entry is the sink logit."""
    keys = k_pool[g.locs].to(q.dtype).transpose(1, 2)  # [n, Hkv, L, D]
    values = v_pool[g.locs].to(q.dtype).transpose(1, 2)
    queries = q[g.q_rows].transpose(1, 2)  # [n, Hq, Q, D]
    mask = g.mask[:, 0]  # [n, Q, L]
    num_k = mask.shape[2]
    # a query's absolute position: its last visible key (the plan's causal rule)
    q_pos = torch.arange(num_k, device=q.device).expand_as(mask).masked_fill(~mask, -1).amax(-1)  # [n, Q]
    distance = q_pos[:, :, None] - torch.arange(num_k, device=q.device)  # [n, Q, L]
    bias = _bias(rel[g.q_rows], proj, distance).transpose(1, 2)  # [n, Hq, Q, L]
    bias = bias.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        keys = torch.cat([keys, keys.new_zeros(*keys.shape[:2], 1, keys.shape[3])], dim=2)
        values = torch.cat([values, values.new_zeros(*values.shape[:2], 1, values.shape[3])], dim=2)
        sink = sinks[g.q_rows].float().transpose(1, 2)[..., None]  # [n, Hq, Q, 1]
        bias = torch.cat([bias, sink], dim=-1)
    bias = bias.to(q.dtype)
    o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)
    out[g.out_rows] = o.transpose(1, 2)[g.q_valid]


def _attend_uniform(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    page_table: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
    rel: Tensor,
    proj: Tensor,
    window: int | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """B sequences of T / B new tokens each, every page of the table read (no host read).
    As ``attend_uniform``, sums run over a page's offsets, then over the pages (one sum over a
    dynamic length would make inductor guard on its size)."""
    num_seqs, max_pages = page_table.shape
    q_len = q.shape[0] // num_seqs
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    offsets = torch.arange(page_size, device=q.device)
    locs = page_table.long()[:, :, None] * page_size + offsets  # [B, N, P]
    queries = q.view(num_seqs, q_len, 1, 1, kv_heads, group, head_dim)
    keys = k_pool[locs].to(q.dtype)[:, None, :, :, :, None, :]  # [B, 1, N, P, Hkv, 1, D]
    scores = (queries * keys).sum(-1) * scale  # [B, Q, N, P, Hkv, G]
    abs_q = seq_lens.long()[:, None] - q_len + torch.arange(q_len, device=q.device)  # [B, Q]
    key_pos = torch.arange(max_pages, device=q.device)[:, None] * page_size + offsets  # [N, P]
    distance = abs_q[:, :, None, None] - key_pos  # [B, Q, N, P]
    bias = _bias(rel.view(num_seqs, q_len, heads, -1), proj, distance.flatten(2))  # [B, Q, H, N * P]
    bias = bias.view(num_seqs, q_len, kv_heads, group, max_pages, page_size).permute(0, 1, 4, 5, 2, 3)
    scores = scores + bias.to(scores.dtype)
    mask = distance >= 0
    if window is not None:
        mask &= distance < window
    scores = scores.masked_fill(~mask[..., None, None], float("-inf"))
    top = scores.amax(dim=(2, 3), keepdim=True)  # key 0 is always visible
    if sinks is not None:
        sink = sinks.view(num_seqs, q_len, 1, 1, kv_heads, group).to(scores.dtype)
        top = torch.maximum(top, sink)
    weights = (scores - top).exp()
    total = weights.sum(3).sum(2)  # [B, Q, Hkv, G]
    if sinks is not None:
        total = total + (sink - top).exp()[:, :, 0, 0]
    values = v_pool[locs].to(q.dtype)[:, None, :, :, :, None, :]  # [B, 1, N, P, Hkv, 1, Dv]
    o = (weights[..., None] * values).sum(3).sum(2) / total[..., None]  # [B, Q, Hkv, G, Dv]
    return o.reshape(q.shape[0], heads, v_pool.shape[-1])
