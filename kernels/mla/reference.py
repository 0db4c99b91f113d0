"""MLA over the paged latent pool, torch reference (the CPU path): see ``kernels.mla``."""

from __future__ import annotations

from torch import Tensor

from kernels.attention.reference import attend_paged


def check_shapes(q: Tensor, latent: Tensor, pool: Tensor, latent_dim: int) -> None:
    width = q.shape[-1]
    ok = (
        q.dim() == 3
        and latent.shape == (q.shape[0], width)
        and pool.dim() == 3
        and pool.shape[1:] == (1, width)
        and 0 < latent_dim <= width
    )
    if not ok:
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)} [T, H, R + P], latent "
            f"{tuple(latent.shape)} [T, R + P], pool {tuple(pool.shape)} "
            f"[L, 1, R + P], latent_dim R={latent_dim}"
        )


def write_latent(latent: Tensor, pool: Tensor, out_loc: Tensor) -> None:
    pool[out_loc.long(), 0] = latent.to(pool.dtype)


def mla_attention_torch(
    q: Tensor,
    latent: Tensor,
    pool: Tensor,
    out_loc: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
    latent_dim: int,
) -> Tensor:
    check_shapes(q, latent, pool, latent_dim)
    write_latent(latent, pool, out_loc)
    # keys: the whole row [c | k_r]; values: a view of its first R channels (no copy)
    return attend_paged(q, pool, pool[..., :latent_dim], page_table, cu_seqlens, seq_lens, page_size, scale)
