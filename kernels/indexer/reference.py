"""Block-sparse indexed attention (``indexed_attention``), torch reference: the CPU path and
the oracle of the Triton kernels. Contract in ``kernels.indexer``.

Invariants kept here (and by the Triton kernels):

* a query row's selection depends only on its own indexer query, its position and the block
  keys of the blocks it may see, never on the batch, the chunk split or the row's neighbours:
  every score is a per-(row, block) sum over the head dim then over the heads (inner-dim
  reductions, no batched matmul whose blocking could depend on the shapes);
* ties in the block score go to the lower block index (a stable descending sort);
* the selected positions of a row are written in ascending order, ``-1`` after them.
"""

from __future__ import annotations

import torch
from torch import Tensor

ROW_CHUNK_ELEMENTS = 1 << 24  # fp32 elements of one chunk's [rows, N, H, D] products


def out_width(block_size: int, top_blocks: int, tail: bool) -> int:
    """Columns of a selection: ``top_blocks`` whole blocks, plus the partial tail block."""
    return top_blocks * block_size + (block_size - 1 if tail else 0)


def row_layout(cu_seqlens: Tensor, seq_lens: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """(sequence, absolute position) of each packed query row, without a host read."""
    rows = torch.arange(num_rows, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
    start = cu_seqlens.long()[seq]
    q_len = cu_seqlens.long()[seq + 1] - start
    return seq, seq_lens.long()[seq] - q_len + rows - start


def block_scores(q: Tensor, weights: Tensor | None, keys: Tensor, pre_scale: float, post_scale: float) -> Tensor:
    """q [T, H, D]; weights [T, H] or None; keys [T, N, D] (each row's candidate block keys)
    -> [T, N] fp32: ``post_scale * sum_h w[t, h] * relu(pre_scale * q[t, h] . keys[t, n])``."""
    dots = (q.float()[:, None, :, :] * keys.float()[:, :, None, :]).sum(-1)  # [T, N, H]
    heads = torch.relu(dots * pre_scale) if pre_scale != 1.0 else torch.relu(dots)
    if weights is not None:
        heads = heads * weights.float()[:, None, :]
    scores = heads.sum(-1)
    if post_scale != 1.0:
        scores = scores * post_scale
    return scores + 0.0  # -0.0 -> +0.0: one zero for the tie rule


def top_block_mask(scores: Tensor, num_visible: Tensor, top_blocks: int) -> Tensor:
    """scores [T, N]; num_visible [T] (blocks 0 .. n-1 may be chosen) -> bool [T, N]: the
    ``min(top_blocks, n)`` highest scores of each row, ties to the lower block index."""
    n_cols = scores.shape[1]
    cols = torch.arange(n_cols, device=scores.device)
    visible = cols[None, :] < num_visible[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices
    keep = torch.minimum(num_visible, torch.full_like(num_visible, top_blocks))
    ranked = cols[None, :] < keep[:, None]  # the first `keep` of the order
    return torch.zeros_like(visible).scatter(1, order, ranked)


def positions_from_blocks(chosen: Tensor, q_pos: Tensor, block_size: int, top_blocks: int, tail: bool) -> Tensor:
    """chosen [T, N] blocks (at most ``top_blocks`` a row); q_pos [T] -> int32 [T, width]: the
    blocks' positions in ascending order, then (``tail``) the row's partial block up to q_pos,
    then -1."""
    # top_blocks never-chosen columns more: the kept blocks are always top_blocks columns wide,
    # whatever N (a traced step's N is dynamic: min(N, top_blocks) would specialise it)
    chosen = torch.cat([chosen, chosen.new_zeros(chosen.shape[0], top_blocks)], dim=1)
    n_blocks = chosen.shape[1]
    width = out_width(block_size, top_blocks, tail)
    cols = torch.arange(n_blocks, device=chosen.device)
    blocks = torch.where(chosen, cols, n_blocks).sort(dim=1).values[:, :top_blocks]  # ascending, N = none
    offsets = torch.arange(block_size, device=chosen.device)
    values = [(blocks[:, :, None] * block_size + offsets).flatten(1)]
    slot = torch.arange(blocks.shape[1], device=chosen.device)[:, None] * block_size + offsets  # [K', C]
    slots = [torch.where(blocks[:, :, None] < n_blocks, slot, width).flatten(1)]
    if tail:
        kept = chosen.sum(1, keepdim=True)
        tail_start = (q_pos[:, None] + 1) // block_size * block_size
        lane = offsets[None, : block_size - 1]
        values.append(tail_start + lane)
        slots.append(torch.where(tail_start + lane <= q_pos[:, None], kept * block_size + lane, width))
    out = torch.full((chosen.shape[0], width + 1), -1, dtype=torch.long, device=chosen.device)
    out.scatter_(1, torch.cat(slots, 1), torch.cat(values, 1))
    return out[:, :width].to(torch.int32)


def select_positions_torch(
    q: Tensor,
    weights: Tensor | None,
    block_keys: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    block_size: int,
    top_blocks: int,
    pre_scale: float = 1.0,
    post_scale: float = 1.0,
    tail: bool = True,
) -> Tensor:
    """Contract of ``kernels.indexer.select_positions``, in torch."""
    check_select(q, weights, block_keys, block_size, top_blocks)
    seq, q_pos = row_layout(cu_seqlens, seq_lens, q.shape[0])
    num_visible = torch.clamp((q_pos + 1) // block_size, max=block_keys.shape[1])
    # Rows are independent: score them in chunks that keep the [rows, N, H, D] product small;
    # a traced step (a compiled decode of a few rows) takes one chunk, so no guard on N.
    if torch.compiler.is_compiling():
        step = max(1, q.shape[0])
    else:
        step = max(1, ROW_CHUNK_ELEMENTS // max(1, block_keys.shape[1] * q.shape[1] * q.shape[2]))
    parts = []
    for r in range(0, q.shape[0], step):
        rows = slice(r, r + step)
        w = None if weights is None else weights[rows]
        scores = block_scores(q[rows], w, block_keys[seq[rows]], pre_scale, post_scale)
        chosen = top_block_mask(scores, num_visible[rows], top_blocks)
        parts.append(positions_from_blocks(chosen, q_pos[rows], block_size, top_blocks, tail))
    if not parts:
        return torch.full((0, out_width(block_size, top_blocks, tail)), -1, dtype=torch.int32, device=q.device)
    return torch.cat(parts)


def check_select(q: Tensor, weights: Tensor | None, block_keys: Tensor, block_size: int, top_blocks: int) -> None:
    if block_size < 1 or top_blocks < 0:
        raise ValueError(f"block_size must be >= 1 and top_blocks >= 0, got {block_size}, {top_blocks}")
    if q.dim() != 3 or block_keys.dim() != 3 or q.shape[2] != block_keys.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and block_keys {tuple(block_keys.shape)} must be [T, H, D], [B, N, D]")
    if weights is not None and tuple(weights.shape) != tuple(q.shape[:2]):
        raise ValueError(f"weights {tuple(weights.shape)} must be [T, H] = {tuple(q.shape[:2])}")


def pool_locations(positions: Tensor, seq: Tensor, page_table: Tensor, page_size: int) -> Tensor:
    """positions [T, W] (-1: none) of the rows' sequences ``seq`` [T] -> flat pool rows
    [T, W] int64 (row 0 for the -1 entries)."""
    pos = positions.long().clamp(min=0)
    pages = page_table.long()[seq[:, None], pos // page_size]
    return torch.where(positions >= 0, pages * page_size + pos % page_size, 0)


def sparse_attention_torch(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    positions: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
) -> Tensor:
    """Contract of ``kernels.indexer.sparse_attention``, in torch (fp32 softmax)."""
    num_rows, num_heads, _ = q.shape
    kv_heads = k_pool.shape[1]
    if num_heads % kv_heads != 0 or q.shape[2] != k_pool.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k_pool {tuple(k_pool.shape)} disagree (GQA, head dim)")
    seq, _ = row_layout(cu_seqlens, seq_lens, num_rows)
    locs = pool_locations(positions, seq, page_table, page_size)  # [T, W]
    keys = k_pool[locs].float()  # [T, W, Hkv, D]
    values = v_pool[locs].float()  # [T, W, Hkv, Dv]
    queries = q.float().view(num_rows, kv_heads, num_heads // kv_heads, q.shape[2])
    scores = torch.einsum("tkgd,twkd->tkgw", queries, keys) * scale
    selected = (positions >= 0)[:, None, None, :]
    probs = torch.softmax(scores.masked_fill(~selected, float("-inf")), dim=-1)
    probs = torch.where(selected.any(-1, keepdim=True), probs, 0.0)  # a row that selects nothing: zeros
    out = torch.einsum("tkgw,twkd->tkgd", probs, values)
    return out.reshape(num_rows, num_heads, v_pool.shape[-1]).to(q.dtype)
