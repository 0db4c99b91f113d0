"""Stage (a) rows for the Triton kernels of the 2026 families: RecurrentGemma's RG-LRU
(``kernels/rglru``: gates + scan in one kernel), Zamba's Mamba1 heads (``kernels/selective_scan``
with B / C grouped per head; the ungrouped Jamba form is ``checks_kernels.mamba1_case``'s own
row) and the block-sparse indexer (``kernels/indexer``: ``select_positions`` = scoring + top-k,
``sparse_attention`` over a paged pool) in Qwen4-Exp's flavour (no weights, pre 1, post
1/sqrt(D), GQA attention) and GLM-5.3-Flash's (weights, pre 1/sqrt(D), MLA latent pool).

Sizes: RecurrentGemma-2b (lru_width 2560); Zamba-7B-v1 (d_inner 2 x 3712, d_state 16, 2 Mamba
heads); GLM-5.3-Flash from transformers' ``Glm5NextTextConfig`` defaults (32 indexer heads of
128, k-pool 16, top-k 2048, MLA 64 heads over a 512 latent, qk head dim 256); Qwen4-Exp's
attention from ``Qwen4ExpTextConfig`` (16 q / 2 kv heads of 256, rotary 64) -- its config has
no indexer defaults, so the indexer takes 4 heads of 128, compress ratio 4, budget 2048, the
shapes TensorRT-Edge-LLM's QSA indexer documents ([B, S, 4, 128] queries, ceil(L / 4) blocks,
2051 = 2048 + 4 - 1 output columns); check them against the released config.json. The
indexer batch: contexts up to ~4k tokens, decode and verify rows, a fresh prefill, a
continuation chunk and an idle sequence; toy sizes for ``--dry-run``.

Selection rows compare positions, not values. The kernel and the reference both keep the
``min(k, n)`` best visible blocks with ties to the lower block, so on exact arithmetic they
agree; their fp32 score sums run in different orders, so a block whose score is within float
noise of the k-th best may land on either side. A row's positions must therefore be identical
to the reference's, except that the two sets of kept blocks may differ in blocks whose
reference score lies within ``TIE_RTOL`` x (the row's largest |score|) of the k-th best
reference score; the tail (partial block) and the layout (ascending, whole blocks, -1 padding)
must be identical. The error column of a selection row is the largest such distance, relative
to the row's largest |score| (0 when every row is identical). The sparse-attention rows run
both implementations on the reference's positions and compare values as the attention rows do.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from kernels.indexer import gather_block_rows, glm5_block_keys, qwen4_block_keys
from kernels.recurrent_batch import RecurrentBatch
from tests.gpu.common import Compared, compare, cuda_ms, worst
from tests.kernels.attention_cases import build_case, expected_pools
from tests.kernels.indexer_cases import rope_table

Result = tuple[Compared, float | None]
Batch = tuple[list[int], tuple]  # lens, (cu, slots, has_init, dst, num_slots)
Check = tuple[str, list[torch.dtype], Callable[[torch.dtype], Result]]
TIE_RTOL = 1e-4  # fp32 sums of bf16 / fp32 products in another order differ by ~1e-6 relative
SELECT_TOL_LABEL = f"= ref (ties {TIE_RTOL:g})"


class Indexer(NamedTuple):
    glm: bool  # GLM-5.3's flavour (weights, pre 1/sqrt(D), MLA); else Qwen4-Exp's
    heads: int  # indexer heads
    dim: int  # indexer head dim D
    block: int  # C: Qwen4 indexer_compress_ratio, GLM index_kpool
    top_blocks: int  # Qwen4 indexer_budget // C, GLM index_topk // C
    rope: int  # Qwen4: rotary channels of the block keys (GLM: none)
    attention: tuple[int, int, int]  # q heads, kv heads, key dim (MLA: heads, 1, kv_lora_rank)
    scale_dim: int  # softmax scale = scale_dim ** -0.5 (GLM: qk_head_dim)


class Sizes2026(NamedTuple):
    rglru: int  # lru_width
    rglru_decodes: int
    zamba: tuple[int, int, int]  # d_inner, d_state, Mamba heads (the B / C groups)
    qwen4: Indexer
    glm5: Indexer
    seqs: tuple[tuple[int, int], ...]  # indexer batch: (cached prefix, new tokens)
    page_size: int


FULL_2026 = Sizes2026(
    rglru=2560,
    rglru_decodes=512,
    zamba=(7424, 16, 2),
    qwen4=Indexer(False, 4, 128, 4, 512, 64, (16, 2, 256), 256),
    glm5=Indexer(True, 32, 128, 16, 128, 0, (64, 1, 512), 256),
    seqs=((3800, 1), (2500, 1), (1030, 1), (4000, 4), (0, 300), (2900, 200), (100, 0)),
    page_size=16,
)
TOY_2026 = Sizes2026(
    rglru=160,  # two channel blocks, the second partial
    rglru_decodes=3,
    zamba=(24, 16, 2),
    qwen4=Indexer(False, 4, 16, 4, 3, 8, (4, 2, 16), 16),
    glm5=Indexer(True, 4, 16, 4, 2, 0, (4, 1, 32), 16),
    seqs=((30, 1), (17, 1), (0, 12), (20, 5), (9, 0)),
    page_size=4,
)


def rglru_case(batch: Batch, width: int, dtype: torch.dtype, device: torch.device, tol: dict, pool_tol) -> Result:
    """The fused Triton RG-LRU against the torch reference (per-token and chunked scans) on a
    mixed varlen batch with snapshots; position 0 (the state reset) at the start of every
    sequence without an initial state and at a few tokens inside sequences."""
    from kernels.rglru.reference import rglru_torch, softplus_scale
    from kernels.rglru.triton_scan import rglru_triton

    lens, (cu, slots, has_init, dst, num_slots) = batch
    num_tokens = sum(lens)
    x, gx, ga = (torch.randn(num_tokens, width, device=device).to(dtype) for _ in range(3))
    scale = softplus_scale(torch.randn(width, device=device) - 2.0)
    reset = torch.rand(num_tokens, device=device) < 0.01
    starts = cu[:-1].long()[(torch.tensor(lens, device=device) > 0) & ~has_init.bool()]
    reset[starts] = True
    pool = torch.randn(num_slots, width, device=device)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    seqs = RecurrentBatch(cu, slots, has_init, dst)
    ref = rglru_torch(x, gx, ga, scale, reset, ref_pool, seqs)

    def call() -> torch.Tensor:
        return rglru_triton(x, gx, ga, scale, reset, tri_pool, seqs)

    out = call()
    return worst(compare(out, ref, *tol[dtype]), compare(tri_pool, ref_pool, *pool_tol)), cuda_ms(call)


def rglru_decode_case(
    num_seqs: int, width: int, dtype: torch.dtype, device: torch.device, tol: dict, pool_tol
) -> Result:
    """A decode step: the reference's one-step form against the kernel, same batch object."""
    from kernels.rglru.reference import rglru_torch, softplus_scale
    from kernels.rglru.triton_scan import rglru_triton

    slots = (torch.randperm(2 * num_seqs, device=device)[:num_seqs] + 1).to(torch.int32)
    x, gx, ga = (torch.randn(num_seqs, width, device=device).to(dtype) for _ in range(3))
    scale = softplus_scale(torch.randn(width, device=device) - 2.0)
    reset = torch.zeros(num_seqs, dtype=torch.bool, device=device)
    pool = torch.randn(2 * num_seqs + 1, width, device=device)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    seqs = RecurrentBatch.decode(slots)
    ref = rglru_torch(x, gx, ga, scale, reset, ref_pool, seqs)

    def call() -> torch.Tensor:
        return rglru_triton(x, gx, ga, scale, reset, tri_pool, seqs)

    out = call()
    return worst(compare(out, ref, *tol[dtype]), compare(tri_pool, ref_pool, *pool_tol)), cuda_ms(call)


def indexer_inputs(sz: Sizes2026, ix: Indexer, dtype: torch.dtype, device: torch.device) -> tuple[dict, dict]:
    """(select kwargs, attention case) on ``device``: indexer queries, weights (GLM) and the
    block keys pooled from a per-token indexer pool under the case's shuffled page table;
    the attention case's pools already hold the new tokens (an MLA latent pool for GLM)."""
    h_q, h_kv, dim = ix.attention
    case = build_case(list(sz.seqs), sz.page_size, h_q, h_kv, seed=ix.dim + ix.block, head_dim=dim)
    case["k_pool"], case["v_pool"] = expected_pools(case)
    gen = torch.Generator().manual_seed(ix.heads)
    num_rows = case["q"].shape[0]
    width = 2 * ix.dim if ix.glm else ix.dim
    token_pool = torch.randn(case["k_pool"].shape[0], width, generator=gen)
    rows = gather_block_rows(token_pool.to(device, dtype), case["page_table"].to(device), sz.page_size, ix.block)
    if ix.glm:
        ape = torch.randn(ix.block, ix.dim, generator=gen).to(device, dtype)
        keys = glm5_block_keys(rows, ape)
    else:
        cos, sin = rope_table(rows.shape[1] * ix.block, ix.rope)
        starts = torch.arange(rows.shape[1]) * ix.block
        norm_w = (torch.randn(ix.dim, generator=gen) * 0.3).to(device, dtype)
        keys = qwen4_block_keys(rows, norm_w, 1e-6, cos[starts].to(device), sin[starts].to(device))
    weights = torch.randn(num_rows, ix.heads, generator=gen) * ix.heads**-0.5 if ix.glm else None
    select = dict(
        q=torch.randn(num_rows, ix.heads, ix.dim, generator=gen).to(device, dtype),
        weights=None if weights is None else weights.to(device),  # fp32, as the model passes them
        block_keys=keys.contiguous(),
        cu_seqlens=case["cu_seqlens"].to(device),
        seq_lens=case["seq_lens"].to(device),
        block_size=ix.block,
        top_blocks=ix.top_blocks,
        pre_scale=ix.dim**-0.5 if ix.glm else 1.0,
        post_scale=1.0 if ix.glm else ix.dim**-0.5,
        tail=True,  # Qwen4 always; GLM index_kpool_always_select_tail (its default)
    )
    names = ("q", "k_pool", "v_pool", "page_table", "cu_seqlens", "seq_lens")
    attend = {n: case[n].to(device) for n in names}
    for n in ("q", "k_pool", "v_pool"):
        attend[n] = attend[n].to(dtype)
    if ix.glm:  # MLA's absorbed form: the latent pool as keys, its first R channels as values
        attend["v_pool"] = attend["k_pool"][..., :dim]
    return select, dict(attend, page_size=sz.page_size, scale=ix.scale_dim**-0.5)


def compare_selection(got: torch.Tensor, want: torch.Tensor, args: dict) -> Compared:
    """Identical positions, except kept blocks tied with the k-th best within float noise
    (the module's docstring); max_err: the largest such tie distance, relative."""
    from kernels.indexer.reference import block_scores, row_layout

    if got.shape != want.shape:
        return Compared(math.inf, False)
    differ = (got != want).any(dim=1).nonzero().flatten()
    if differ.numel() == 0:
        return Compared(0.0, True)
    seq, q_pos = row_layout(args["cu_seqlens"], args["seq_lens"], got.shape[0])
    c, top = args["block_size"], args["top_blocks"]
    weights = args["weights"]
    scores = block_scores(
        args["q"][differ],
        None if weights is None else weights[differ],
        args["block_keys"][seq[differ]],
        args["pre_scale"],
        args["post_scale"],
    )
    worst_gap = 0.0
    for i, row in enumerate(differ.tolist()):
        nb = min((int(q_pos[row]) + 1) // c, args["block_keys"].shape[1])
        kk = min(nb, top)
        if not torch.equal(got[row, kk * c :], want[row, kk * c :]):
            return Compared(math.inf, False)  # the tail and the padding must be identical
        blocks = got[row, : kk * c : c].long() // c
        layout = (blocks[:, None] * c + torch.arange(c, device=got.device)).flatten()
        if not torch.equal(got[row, : kk * c].long(), layout) or bool((blocks >= nb).any()):
            return Compared(math.inf, False)
        if kk > 1 and not bool((blocks[1:] > blocks[:-1]).all()):
            return Compared(math.inf, False)
        ref_blocks = want[row, : kk * c : c].long() // c
        moved = torch.tensor(sorted(set(blocks.tolist()) ^ set(ref_blocks.tolist())), device=got.device)
        if moved.numel() == 0:
            continue
        row_scores = scores[i, :nb]
        kth = torch.topk(row_scores, kk).values[-1]
        gap = float((row_scores[moved] - kth).abs().max() / row_scores.abs().max().clamp_min(1e-30))
        worst_gap = max(worst_gap, gap)
    print(f"indexer select: {differ.numel()} of {got.shape[0]} rows differ from the reference (gap {worst_gap:.3g})")
    return Compared(worst_gap, worst_gap <= TIE_RTOL)


def select_case(sz: Sizes2026, ix: Indexer, dtype: torch.dtype, device: torch.device) -> Result:
    from kernels.indexer.reference import select_positions_torch
    from kernels.indexer.triton_select import select_positions_triton

    args, _ = indexer_inputs(sz, ix, dtype, device)
    res = compare_selection(select_positions_triton(**args), select_positions_torch(**args), args)
    return res, cuda_ms(lambda: select_positions_triton(**args))


def sparse_case(sz: Sizes2026, ix: Indexer, dtype: torch.dtype, device: torch.device, tol: dict) -> Result:
    from kernels.indexer.reference import select_positions_torch, sparse_attention_torch
    from kernels.indexer.triton_sparse import sparse_attention_triton

    select, attend = indexer_inputs(sz, ix, dtype, device)
    attend["positions"] = select_positions_torch(**select)
    out = sparse_attention_triton(**attend)
    res = compare(out, sparse_attention_torch(**attend), *tol[dtype])
    return res, cuda_ms(lambda: sparse_attention_triton(**attend))


def checks_2026(
    sz: Sizes2026,
    mixed: Callable[[int], Batch],
    mamba1: Callable[..., Result],
    device: torch.device,
    tol: dict,
    pool_tol: tuple[float, float],
) -> list[Check]:
    """Rows for ``checks_kernels.checks``: ``mixed(seed)`` builds its mixed varlen batch;
    ``mamba1(batch, (channels, state), dtype, device, groups)`` is its selective-scan row."""
    both, bf16 = [torch.bfloat16, torch.float32], [torch.bfloat16]
    channels, state, groups = sz.zamba
    rows: list[Check] = [
        (
            f"rglru varlen w{sz.rglru} (gates + scan, snapshots)",
            both,
            lambda dt: rglru_case(mixed(9), sz.rglru, dt, device, tol["mamba1"], pool_tol),
        ),
        (
            f"rglru decode {sz.rglru_decodes} seqs w{sz.rglru} (one-step reference)",
            bf16,
            lambda dt: rglru_decode_case(sz.rglru_decodes, sz.rglru, dt, device, tol["mamba1"], pool_tol),
        ),
        (
            f"mamba1 selective scan varlen, B/C in {groups} groups (Zamba heads) {channels}x{state}",
            both,
            lambda dt: mamba1(mixed(10), (channels, state), dt, device, groups),
        ),
    ]
    for label, ix in (("qwen4-exp", sz.qwen4), ("glm-5.3", sz.glm5)):
        h_q, h_kv, dim = ix.attention
        pool = f"mla {h_q}h r{dim}" if ix.glm else f"{h_q}q/{h_kv}kv d{dim}"
        rows += [
            (
                f"indexer select {label} {ix.heads}h d{ix.dim} C{ix.block} top {ix.top_blocks}",
                both,
                lambda dt, ix=ix: select_case(sz, ix, dt, device),
            ),
            (
                f"indexer sparse attention {label} {pool}",
                bf16 if ix.glm else both,  # GLM-5.3 serves bf16; fp32 [64 x 512] tiles are a lot
                lambda dt, ix=ix: sparse_case(sz, ix, dt, device, tol["exact"]),
            ),
        ]
    return rows
