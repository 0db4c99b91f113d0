"""Stage (a) rows for the kernels of the KDA / MLA / lightning families: the Triton
KDA (chunked + recurrent, snapshots), the Triton MLA kernel over a paged latent pool, and
lightning attention through the SSD kernels with its arguments (dt = 1, one group per
head). Sizes: Kimi-Linear's KDA (32 heads of 128) and MLA (32 heads, latent 512, rope 64),
MiniMax's lightning attention (64 heads of 128); toy ones for ``--dry-run``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from kernels.recurrent_batch import RecurrentBatch
from tests.gpu.common import Compared, compare, cuda_ms, worst
from tests.kernels.mla_cases import mla_case, run_mla

Result = tuple[Compared, float | None]
Batch = tuple[list[int], tuple]  # lens, (cu, slots, has_init, dst, num_slots)


class NewKernelSizes(NamedTuple):
    kda: tuple[int, int]  # heads, head dim (K = V)
    mla: tuple[int, int, int]  # heads, kv_lora_rank, qk_rope_head_dim
    lightning: tuple[int, int]  # heads, head dim


FULL_NEW = NewKernelSizes(kda=(32, 128), mla=(32, 512, 64), lightning=(64, 128))
TOY_NEW = NewKernelSizes(kda=(2, 16), mla=(4, 32, 16), lightning=(2, 16))


def kda_case(
    batch: Batch,
    heads: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    tol: tuple[float, float],
    pool_tol: tuple[float, float],
) -> Result:
    from kernels.kda.reference import kda_varlen_torch
    from kernels.kda.triton_varlen import kda_varlen_triton

    lens, (cu, slots, has_init, dst, num_slots) = batch
    (num_heads, dim), num_tokens = heads, sum(lens)
    q, k, v = (torch.randn(num_tokens, num_heads, dim, device=device).to(dtype) for _ in range(3))
    g = -torch.rand(num_tokens, num_heads, dim, device=device) * 0.3  # per channel
    beta = torch.rand(num_tokens, num_heads, device=device).to(dtype)
    pool = torch.randn(num_slots, num_heads, dim, dim, device=device) * 0.1
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref = kda_varlen_torch(q, k, v, g, beta, ref_pool, cu, slots, has_init, None, True, 32, dst)

    def call() -> torch.Tensor:
        return kda_varlen_triton(q, k, v, g, beta, tri_pool, RecurrentBatch(cu, slots, has_init, dst))

    out = call()
    return worst(compare(out, ref, *tol), compare(tri_pool, ref_pool, *pool_tol)), cuda_ms(call)


def lightning_case(
    batch: Batch,
    heads: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    tol: tuple[float, float],
    pool_tol: tuple[float, float],
) -> Result:
    from kernels import backend
    from kernels.lightning import lightning_attention

    lens, (cu, slots, has_init, dst, num_slots) = batch
    (num_heads, dim), num_tokens = heads, sum(lens)
    q, k, v = (torch.randn(num_tokens, num_heads, dim, device=device).to(dtype) * 0.3 for _ in range(3))
    slope = torch.rand(num_heads, device=device) * 0.5 + 0.01
    pool = torch.randn(num_slots, num_heads, dim, dim, device=device) * 0.1
    ref_pool, tri_pool = pool.clone(), pool.clone()
    with backend.use_backend("torch"):
        ref = lightning_attention(q, k, v, slope, ref_pool, RecurrentBatch(cu, slots, has_init, dst))

    def call() -> torch.Tensor:
        with backend.use_backend("triton"):
            return lightning_attention(q, k, v, slope, tri_pool, RecurrentBatch(cu, slots, has_init, dst))

    out = call()
    return worst(compare(out, ref, *tol), compare(tri_pool, ref_pool, *pool_tol)), cuda_ms(call)


def mla_row(
    seqs: list[tuple[int, int]],
    dims: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    tol: tuple[float, float],
) -> Result:
    """The Triton MLA kernel against the torch path on the same device; the pools must receive
    exactly the same latents."""
    from kernels.mla.reference import mla_attention_torch
    from kernels.mla.triton_paged import mla_attention_triton

    heads, rank, rope = dims
    case = mla_case(seqs, 16, heads, rank, rope, seed=rank)
    for name in ("q", "latent", "pool"):
        case[name] = case[name].to(dtype)
    scale = (128 + rope) ** -0.5
    out, pool = run_mla(mla_attention_triton, case, scale, device)
    want, want_pool = run_mla(mla_attention_torch, case, scale, device)
    args = {n: case[n].to(device) for n in ("q", "latent", "pool", "out_loc", "page_table", "cu_seqlens", "seq_lens")}
    res = worst(compare(out, want, *tol), compare(pool, want_pool, 0.0, 0.0))
    return res, cuda_ms(lambda: mla_attention_triton(**args, page_size=16, scale=scale, latent_dim=rank))


Check = tuple[str, list[torch.dtype], Callable[[torch.dtype], Result]]


def new_checks(
    sz: NewKernelSizes,
    mixed: Callable[[int], Batch],
    attention_mixed: list,
    attention_decode: list,
    device: torch.device,
    tol: dict,
    pool_tol: tuple[float, float],
) -> list[Check]:
    """Rows for ``checks_kernels.checks``: ``mixed(seed)`` builds its mixed varlen batch."""
    both = [torch.bfloat16, torch.float32]
    rows: list[Check] = [
        (
            f"kda varlen {sz.kda[0]}x{sz.kda[1]} (chunked + recurrent, snapshots)",
            both,
            lambda dt: kda_case(mixed(7), sz.kda, dt, device, tol["gdn"][dt], pool_tol),
        ),
        (
            f"lightning (ssd kernels) {sz.lightning[0]}x{sz.lightning[1]}",
            [torch.bfloat16],
            lambda dt: lightning_case(mixed(8), sz.lightning, dt, device, tol["ssd"][dt], pool_tol),
        ),
    ]
    for label, seqs, dtypes in (("mixed", attention_mixed, both), ("decode", attention_decode, [torch.bfloat16])):
        rows.append(
            (
                f"mla triton {label} {sz.mla[0]}h r{sz.mla[1]} p{sz.mla[2]}",
                dtypes,
                lambda dt, s=seqs: mla_row(s, sz.mla, dt, device, tol["exact"][dt]),
            )
        )
    return rows
