"""Block keys of the indexer: each block of ``block_size`` consecutive positions (block j holds
positions ``j * C .. j * C + C - 1``) compressed to one key from the per-token indexer keys in
the paged pool. The model-specific half of ``indexed_attention``, in torch.

The per-token pool ``token_pool`` [L_total, W] is addressed as every paged pool: position
``pos`` of sequence b lives at row ``page_table[b, pos // page_size] * page_size + pos %
page_size``. A block key is a function of its C tokens' rows (and of its first position, for
rope) only, so it is the same in every step, chunk split and batch that sees the block.

* Qwen4-Exp (QSA): W = D, the raw ``index_qk_proj`` key rows (before ``k_layernorm``). The
  key is ``rope(rmsnorm(mean(rows)), first position)``: the mean in fp32 rounded to the pool
  dtype, Qwen4's RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, then rope with the cos/sin
  of the block's first position on the first ``cos.shape[-1]`` channels.
* GLM-5.3-Flash (DSA k-pool): W = 2D, rows ``[k | gate]`` (``k_norm(wk(x))`` and
  ``index_kpool_compress_gate @ x``). The key is ``sum_c softmax_c(gate + ape)[c] * k[c]``
  (softmax over the C tokens in fp32, per channel; rounded to the pool dtype before the sum).
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_block_rows(token_pool: Tensor, page_table: Tensor, page_size: int, block_size: int) -> Tensor:
    """token_pool [L_total, W]; page_table [B, max_pages] -> [B, N, C, W] with N =
    ``max_pages * page_size // C``: every block a page table can address (blocks past a
    sequence's context hold garbage rows: the selection never looks at them)."""
    num_seqs, max_pages = page_table.shape
    num_blocks = max_pages * page_size // block_size
    pos = torch.arange(num_blocks * block_size, device=page_table.device)
    locs = page_table.long()[:, pos // page_size] * page_size + pos % page_size  # [B, N * C]
    return token_pool[locs].view(num_seqs, num_blocks, block_size, token_pool.shape[-1])


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rope (rotate-half) on the first ``cos.shape[-1]`` channels of x; the rest pass."""
    rot = cos.shape[-1]
    head, rest = x[..., :rot], x[..., rot:]
    return torch.cat((head * cos + rotate_half(head) * sin, rest), dim=-1)


def qwen4_block_keys(rows: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """rows [..., C, D] -> [..., D]; cos, sin [..., rot] at each block's first position."""
    pooled = rows.float().mean(dim=-2).to(rows.dtype)
    normed = pooled.float() * torch.rsqrt(pooled.float().pow(2).mean(-1, keepdim=True) + eps)
    normed = (normed * (1.0 + norm_weight.float())).to(rows.dtype)
    return apply_rope(normed, cos.to(normed.dtype), sin.to(normed.dtype))


def glm5_block_keys(rows: Tensor, ape: Tensor) -> Tensor:
    """rows [..., C, 2D] (``[k | gate]``); ape [C, D] -> [..., D]."""
    keys, gates = rows.chunk(2, dim=-1)
    probs = torch.softmax(gates.float() + ape.float(), dim=-2).to(keys.dtype)
    return (probs * keys).sum(dim=-2)
