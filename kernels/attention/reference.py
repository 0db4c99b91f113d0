"""Causal attention over the paged KV pool, torch reference (the CPU path).

Pool layout (``workers/device_pools.py``): ``k_pool`` / ``v_pool`` [L_total, Hkv, D] with
flat location ``page * page_size + offset``. Context position ``pos`` of sequence b lives at
``page_table[b, pos // page_size] * page_size + pos % page_size``.

Sequence b brings ``q_len = cu[b+1] - cu[b]`` new tokens and has ``seq_lens[b]`` context
tokens after this step, so its query i sits at absolute position ``seq_lens[b] - q_len + i``
and attends to context positions ``0 ..`` that position (the new tokens included); with a
sliding ``window`` W only to the last W of them, positions ``p - W + 1 .. p`` (transformers'
rule: key k is visible to query p when ``p - W < k <= p``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import dense
from kernels.memo import TensorMemo
from kernels.static import scatter_rows_, tracing


def check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be a positive number of tokens or None, got {window}")


def check_heads(q: Tensor, k: Tensor) -> None:
    """GQA: Hkv divides Hq, and q and k share the head dim."""
    if q.shape[1] % k.shape[1] != 0 or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree (GQA needs Hkv to divide Hq and equal head dims)"
        )


def write_kv(k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor, out_loc: Tensor) -> None:
    scatter_rows_(k_pool, out_loc, k)
    scatter_rows_(v_pool, out_loc, v)


@dataclass(frozen=True)
class _Group:
    """One padded SDPA call over ``n`` sequences (decodes together, each prefill alone)."""

    q_rows: Tensor  # [n, Q] rows of q (clamped for padding)
    out_rows: Tensor  # [valid] the rows it produces, in q_valid order
    q_valid: Tensor  # [n, Q]
    locs: Tensor  # [n, L] flat pool locations of each sequence's context
    mask: Tensor  # [n, 1, Q, L] causal and length mask


_plans: TensorMemo[list[_Group]] = TensorMemo()


def paged_attention_torch(
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
    window: int | None = None,
) -> Tensor:
    check_heads(q, k)
    check_window(window)
    write_kv(k, v, k_pool, v_pool, out_loc)
    return attend_paged(q, k_pool, v_pool, page_table, cu_seqlens, seq_lens, page_size, scale, window)


def attend_paged(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """The attention half of ``paged_attention_torch``, over pools that already hold the new
    tokens: q [T, Hq, D]; k_pool [L_total, Hkv, D]; v_pool [L_total, Hkv, Dv] (any strides:
    MLA passes a view of its latent pool) -> [T, Hq, Dv]."""
    if tracing():  # a compiled step: uniform rows, no host-built plan
        return attend_uniform(q, k_pool, v_pool, page_table, seq_lens, page_size, scale, window)
    # The plan depends on the batch metadata (and the window) only: built by the first
    # attention layer of a step, reused by the others (kernels.memo).
    alone = dense.invariant()
    groups = _plans.get(
        (page_table, cu_seqlens, seq_lens),
        (page_size, window, alone),
        lambda: _plan(page_table, cu_seqlens, seq_lens, page_size, window, alone),
    )
    out = q.new_zeros(q.shape[0], q.shape[1], v_pool.shape[-1])
    for group in groups:
        _attend(q, k_pool, v_pool, group, scale, out)
    return out


def attend_uniform(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    page_table: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """``attend_paged`` for a batch whose B sequences all bring T / B new tokens (a padded
    decode or verify step), without a host read: every page of the table ([B, max_pages]),
    keys past each query's position masked. What a traced or captured step runs; the same
    attention as the planned path (extra keys are masked out).

    Written as products and sums over gathered pool rows, not as SDPA over gathered copies:
    inductor fuses each gather into its reduction, so K and V are read once, in place, and
    the padding pages (all page 0) stay in cache (a compiled decode layer several times
    faster: BENCHMARKS.md). Sums over the context run over a page's offsets, then over the
    pages: a single sum over a dynamic length would make inductor guard on its size (cpp
    ``need_use_acc_helper``: 4,096)."""
    num_seqs, max_pages = page_table.shape
    q_len = q.shape[0] // num_seqs
    kv_heads, head_dim = k_pool.shape[1], q.shape[2]
    group = q.shape[1] // kv_heads
    offsets = torch.arange(page_size, device=q.device)
    locs = page_table.long()[:, :, None] * page_size + offsets  # [B, N, P]
    queries = q.view(num_seqs, q_len, 1, 1, kv_heads, group, head_dim)  # [B, Q, 1, 1, Hkv, G, D]
    keys = k_pool[locs].to(q.dtype)[:, None, :, :, :, None, :]  # [B, 1, N, P, Hkv, 1, D]
    scores = (queries * keys).sum(-1) * scale  # [B, Q, N, P, Hkv, G]
    abs_q = seq_lens.long()[:, None] - q_len + torch.arange(q_len, device=q.device)  # [B, Q]
    keys_pos = (torch.arange(max_pages, device=q.device)[:, None] * page_size + offsets)[None, None]
    mask = keys_pos <= abs_q[:, :, None, None]  # [B, Q, N, P]
    if window is not None:
        mask &= keys_pos > abs_q[:, :, None, None] - window
    scores = scores.masked_fill(~mask[..., None, None], float("-inf"))
    top = scores.amax(dim=(2, 3), keepdim=True)  # key 0 is always visible
    weights = (scores - top).exp()  # 0 where masked
    total = weights.sum(3).sum(2)  # [B, Q, Hkv, G]
    values = v_pool[locs].to(q.dtype)[:, None, :, :, :, None, :]  # [B, 1, N, P, Hkv, 1, Dv]
    o = (weights[..., None] * values).sum(3).sum(2) / total[..., None]  # [B, Q, Hkv, G, Dv]
    return o.reshape(q.shape[0], q.shape[1], v_pool.shape[-1])


def _plan(
    page_table: Tensor, cu_seqlens: Tensor, seq_lens: Tensor, page_size: int, window: int | None, alone: bool = False
) -> list[_Group]:
    """The SDPA calls' groups; ``alone`` (the batch-invariant mode) gives each decode its own
    call, as a prefill has: padded to the others' context, its sums would run in other blocks."""
    cu, ctx = cu_seqlens.tolist(), seq_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(ctx))]
    bad = [b for b in range(len(ctx)) if ctx[b] < q_lens[b]]
    if bad:
        raise ValueError(f"seq_lens < new tokens for sequences {bad}: {ctx} vs {q_lens}")
    # Decodes share one padded call; each prefill gets its own (no q_len x padding blow-up).
    decodes = [] if alone else [b for b, n in enumerate(q_lens) if n == 1]
    groups = [[b] for b, n in enumerate(q_lens) if n > 1 or (alone and n == 1)]
    if decodes:
        groups.insert(0, decodes)
    return [_group(page_table, cu, ctx, q_lens, seqs, page_size, window) for seqs in groups]


def _group(
    page_table: Tensor,
    cu: list[int],
    ctx: list[int],
    q_lens: list[int],
    seqs: list[int],
    page_size: int,
    window: int | None,
) -> _Group:
    device = page_table.device
    n_q = torch.tensor([q_lens[b] for b in seqs], device=device)  # [n]
    n_ctx = torch.tensor([ctx[b] for b in seqs], device=device)  # [n]
    starts = torch.tensor([cu[b] for b in seqs], device=device)
    q_pos = torch.arange(max(q_lens[b] for b in seqs), device=device)  # [Q]
    k_pos = torch.arange(max(ctx[b] for b in seqs), device=device)  # [L]
    q_valid = q_pos[None, :] < n_q[:, None]  # [n, Q]
    q_rows = starts[:, None] + torch.minimum(q_pos[None, :], n_q[:, None] - 1)
    locs = _context_locations(page_table, seqs, n_ctx, k_pos, page_size)  # [n, L]
    abs_q = (n_ctx - n_q)[:, None] + q_pos[None, :]  # [n, Q]
    keys_pos = k_pos[None, None, :]
    mask = (keys_pos <= abs_q[:, :, None]) & (keys_pos < n_ctx[:, None, None])  # [n, Q, L]
    if window is not None:
        mask &= keys_pos > abs_q[:, :, None] - window
    return _Group(q_rows, q_rows[q_valid], q_valid, locs, mask[:, None])


def _attend(q: Tensor, k_pool: Tensor, v_pool: Tensor, g: _Group, scale: float, out: Tensor) -> None:
    """SDPA for one group padded to its longest query and context; writes rows of ``out``."""
    keys = k_pool[g.locs].to(q.dtype).transpose(1, 2)  # [n, Hkv, L, D]
    values = v_pool[g.locs].to(q.dtype).transpose(1, 2)
    queries = q[g.q_rows].transpose(1, 2)  # [n, Hq, Q, D]
    o = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=g.mask, scale=scale, enable_gqa=True
    )  # [n, Hq, Q, D]
    out[g.out_rows] = o.transpose(1, 2)[g.q_valid]


def _context_locations(page_table: Tensor, seqs: list[int], n_ctx: Tensor, k_pos: Tensor, page_size: int) -> Tensor:
    """Flat pool locations of context positions ``k_pos`` (clamped to each length): [n, L]."""
    pos = torch.minimum(k_pos[None, :], (n_ctx - 1).clamp(min=0)[:, None])  # [n, L]
    table = page_table[torch.tensor(seqs, device=page_table.device)].long()  # [n, max_pages]
    pages = torch.gather(table, 1, pos // page_size)
    return pages * page_size + pos % page_size
