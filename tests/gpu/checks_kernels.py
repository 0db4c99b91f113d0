"""Stage (a) of the device checks: every Triton kernel against its torch reference.

Real sizes on the GPU (Qwen3-Next GDN and attention, Mamba2 SSD, Jamba's Mamba1 selective
scan, Lfm3's sliding-window attention; KDA, MLA and lightning attention in
``checks_new_kernels``; RecurrentGemma's RG-LRU, Zamba's grouped Mamba1 heads and the
Qwen4-Exp / GLM-5.3 indexer's selection and sparse attention in ``checks_2026_kernels``),
toy sizes for ``--dry-run`` on CPU (the interpreter). One mixed varlen batch per recurrent
op: decodes, speculative verifies (a snapshot after every draft token) and long prefills
with prefix-cache snapshots mid-sequence; fp32 recurrent pools; bf16 and fp32 activations.
Three rows launch grids past CUDA's old axis-1 limit (sequences x heads > 65,535). fp32
``tl.dot`` in the chunked GDN/SSD kernels runs in tf32 on the GPU, hence their fp32
tolerances; the attention kernel's fp32 dots are IEEE. Each row: max |triton - reference|,
pass at the tolerance, the kernel's time (the indexer's selection rows compare positions:
``checks_2026_kernels`` says how).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import backend
from kernels.recurrent_batch import RecurrentBatch
from tests.gpu.checks_2026_kernels import FULL_2026, SELECT_TOL_LABEL, TOY_2026, checks_2026
from tests.gpu.checks_new_kernels import FULL_NEW, TOY_NEW, new_checks
from tests.gpu.common import (
    Compared,
    Deadline,
    Report,
    compare,
    cuda_ms,
    has_flashinfer,
    mixed_lens,
    varlen_meta,
    verify_snapshots,
    worst,
)
from tests.kernels.attention_cases import build_case, run_paged, with_dtype

Tol = tuple[float, float]  # (rtol, atol)
Result = tuple[Compared, float | None]


@dataclass(frozen=True)
class KernelSizes:
    decodes: int
    verifies: int  # of VERIFY_LEN tokens, a snapshot after each
    prefills: list[int]
    snapshot_offsets: list[int]  # prefix-cache snapshots inside the first prefill
    gdn: tuple[int, int, int]  # value heads, key heads, head dim (K = V)
    ssd: tuple[int, int, int]  # heads, head dim P, state dim N
    mamba1: tuple[int, int]  # channels (d_inner), state dim N
    conv_dim: int
    norm_rows: int
    attention: list[tuple[int, int, int]]  # (Hq, Hkv, D)
    attention_mixed: list[tuple[int, int]]  # (cached prefix, new tokens)
    attention_decode: list[tuple[int, int]]
    grid_gdn_decodes: int  # x gdn heads > 65,535: the old axis-1 grid would fail
    grid_ssd_decodes: int  # x 128 heads > 65,535
    grid_ssd_longs: int  # 17-token prefills (the chunked kernels) x 128 heads


VERIFY_LEN = 4
FULL = KernelSizes(
    decodes=32,
    verifies=8,
    prefills=[700, 129],
    snapshot_offsets=[255, 511],
    gdn=(32, 16, 128),
    ssd=(128, 64, 128),
    mamba1=(8192, 16),
    conv_dim=8192,
    norm_rows=32768,
    attention=[(16, 2, 256), (8, 8, 128), (32, 4, 80)],
    attention_mixed=[(0, 300), (100, 64), (1000, 1), (37, 1), (500, 4), (64, 0), (15, 4), (0, 1)],
    attention_decode=[(1000, 1), (37, 1), (15, 1), (4095, 1), (0, 1)] * 4,
    grid_gdn_decodes=2100,
    grid_ssd_decodes=600,
    grid_ssd_longs=520,
)
TOY = KernelSizes(
    decodes=2,
    verifies=1,
    prefills=[40],
    snapshot_offsets=[20],
    gdn=(4, 2, 16),
    ssd=(4, 16, 16),
    mamba1=(24, 16),
    conv_dim=32,
    norm_rows=64,
    attention=[(4, 2, 32), (6, 2, 80)],
    attention_mixed=[(0, 20), (5, 1), (3, 0), (9, 4)],
    attention_decode=[(30, 1), (0, 1)],
    grid_gdn_decodes=3,
    grid_ssd_decodes=3,
    grid_ssd_longs=2,
)
TOL = {
    "gdn": {torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-2, 1e-2)},
    "ssd": {torch.bfloat16: (2e-2, 5e-2), torch.float32: (1e-2, 2e-2)},
    "mamba1": {torch.bfloat16: (2e-2, 5e-2), torch.float32: (1e-3, 1e-3)},  # no tl.dot
    "exact": {torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-4, 1e-4)},
}
POOL_TOL = (1e-2, 1e-2)


def _randn(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def _mixed(sz: KernelSizes, seed: int, device: torch.device):
    lens = mixed_lens(sz.decodes, sz.verifies, VERIFY_LEN, sz.prefills)
    live = len(lens) + 8
    snaps = verify_snapshots(lens, VERIFY_LEN, first_slot=live + 1)
    start, top = sum(lens[: -len(sz.prefills)]), max(snaps.values(), default=live)
    snaps.update({start + off: top + 1 + i for i, off in enumerate(sz.snapshot_offsets)})
    return lens, varlen_meta(lens, live, snaps, seed=seed, device=device.type)


def _plain(lens: list[int], seed: int, device: torch.device):
    return lens, varlen_meta(lens, len(lens), None, init_prob=1.0, seed=seed, device=device.type)


def gdn_case(batch, heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> Result:
    from kernels.gdn.reference import gated_delta_rule_varlen_torch
    from kernels.gdn.triton_varlen import gated_delta_rule_varlen_triton

    lens, (cu, slots, has_init, dst, num_slots) = batch
    (num_heads, k_heads, dim), num_tokens = heads, sum(lens)
    q, k = (_randn(num_tokens, k_heads, dim, dtype=dtype, device=device) for _ in range(2))
    v = _randn(num_tokens, num_heads, dim, dtype=dtype, device=device)
    g = -torch.rand(num_tokens, num_heads, device=device) * 0.3
    beta = torch.rand(num_tokens, num_heads, device=device).to(dtype)
    pool = torch.randn(num_slots, num_heads, dim, dim, device=device) * 0.1
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref = gated_delta_rule_varlen_torch(q, k, v, g, beta, ref_pool, cu, slots, has_init, None, True, 64, dst)

    def call() -> torch.Tensor:
        return gated_delta_rule_varlen_triton(q, k, v, g, beta, tri_pool, RecurrentBatch(cu, slots, has_init, dst))

    out = call()
    res = worst(compare(out, ref, *TOL["gdn"][dtype]), compare(tri_pool, ref_pool, *POOL_TOL))
    return res, cuda_ms(call)


def ssd_case(batch, heads: tuple[int, int, int], groups: int, dtype: torch.dtype, device: torch.device) -> Result:
    from kernels.ssd.reference import ssd_varlen_torch
    from kernels.ssd.triton_varlen import ssd_varlen_triton

    lens, (cu, slots, has_init, dst, num_slots) = batch
    (num_heads, head_dim, state), num_tokens = heads, sum(lens)
    x = _randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    dt = _randn(num_tokens, num_heads, dtype=dtype, device=device) - 2.0
    A = -torch.rand(num_heads, device=device) * 8 - 1.0
    B, C = (_randn(num_tokens, groups, state, dtype=dtype, device=device) for _ in range(2))
    D = _randn(num_heads, dtype=dtype, device=device)
    dt_bias = _randn(num_heads, dtype=dtype, device=device) * 0.5
    pool = torch.randn(num_slots, num_heads, head_dim, state, device=device) * 0.1
    ref_pool, tri_pool = pool.clone(), pool.clone()
    args = (x, dt, A, B, C, D, dt_bias)
    ref = ssd_varlen_torch(*args, ref_pool, cu, slots, has_init, True, (0.0, float("inf")), 256, dst)

    def call() -> torch.Tensor:
        return ssd_varlen_triton(*args, tri_pool, RecurrentBatch(cu, slots, has_init, dst))

    y = call()
    res = worst(compare(y, ref, *TOL["ssd"][dtype]), compare(tri_pool, ref_pool, *POOL_TOL))
    return res, cuda_ms(call)


def mamba1_case(
    batch, dims: tuple[int, int], dtype: torch.dtype, device: torch.device, groups: int | None = None
) -> Result:
    """Jamba's selective scan (B, C [T, N] shared by every channel) or, with ``groups``,
    Zamba's Mamba heads (B, C [T, G, N]): per-token and chunked (associative scan) kernels."""
    from kernels.selective_scan.reference import selective_scan_varlen_torch
    from kernels.selective_scan.triton_varlen import selective_scan_varlen_triton

    lens, (cu, slots, has_init, dst, num_slots) = batch
    (channels, state), num_tokens = dims, sum(lens)
    x, dt = (_randn(num_tokens, channels, dtype=dtype, device=device) for _ in range(2))
    A = -torch.rand(channels, state, device=device) * 8 - 1.0
    bc = (num_tokens, state) if groups is None else (num_tokens, groups, state)
    B, C = (_randn(*bc, dtype=dtype, device=device) for _ in range(2))
    D = _randn(channels, dtype=dtype, device=device)
    dt_bias = torch.randn(channels, device=device) - 3.0
    pool = torch.randn(num_slots, channels, state, device=device) * 0.1
    ref_pool, tri_pool = pool.clone(), pool.clone()
    args = (x, dt, A, B, C, D, dt_bias)
    ref = selective_scan_varlen_torch(*args, ref_pool, cu, slots, has_init, True, 64, dst)

    def call() -> torch.Tensor:
        return selective_scan_varlen_triton(*args, tri_pool, RecurrentBatch(cu, slots, has_init, dst))

    y = call()
    res = worst(compare(y, ref, *TOL["mamba1"][dtype]), compare(tri_pool, ref_pool, *POOL_TOL))
    return res, cuda_ms(call)


def conv_case(sz: KernelSizes, dtype: torch.dtype, device: torch.device) -> Result:
    """Varlen (prefill, verify, snapshots) then one decode update; states must be exact."""
    from kernels.conv1d.reference import causal_conv1d_update_torch, causal_conv1d_varlen_torch
    from kernels.conv1d.triton_conv import causal_conv1d_update_triton, causal_conv1d_varlen_triton

    lens, (cu, slots, has_init, dst, num_slots) = _mixed(sz, seed=3, device=device)
    num_tokens, dim, width, tol = sum(lens), sz.conv_dim, 4, TOL["exact"][dtype]
    proj = _randn(num_tokens, dim + 64, dtype=dtype, device=device)
    x = proj[:, 32 : 32 + dim]  # a column slice, as in the mixers
    weight = _randn(dim, width, dtype=dtype, device=device) * 0.5
    pool = _randn(num_slots, dim, width - 1, dtype=dtype, device=device)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref = causal_conv1d_varlen_torch(x, weight, None, ref_pool, cu, slots, has_init, "silu", dst)
    out = causal_conv1d_varlen_triton(x, weight, None, tri_pool, cu, slots, has_init, "silu", dst)
    varlen = worst(compare(out, ref, *tol), compare(tri_pool, ref_pool, 0.0, 0.0))
    one = _randn(slots.shape[0], dim, dtype=dtype, device=device)
    ref = causal_conv1d_update_torch(one, weight, None, ref_pool, slots, "silu")

    def call() -> torch.Tensor:
        return causal_conv1d_update_triton(one, weight, None, tri_pool, slots, "silu")

    out = call()
    update = worst(compare(out, ref, *tol), compare(tri_pool, ref_pool, 0.0, 0.0))
    return worst(varlen, update), cuda_ms(call)


def norm_case(sz: KernelSizes, dtype: torch.dtype, device: torch.device) -> Result:
    """GDN's gated norm (per 128-channel head), Mamba2's grouped gate-before-norm, and the
    zero-centred RMSNorm of Qwen3-Next."""
    from kernels.norm.reference import gated_rms_norm_torch, rms_norm_torch
    from kernels.norm.triton_norm import gated_rms_norm_triton, rms_norm_triton

    tol, rows, head = TOL["exact"][dtype], sz.norm_rows, sz.gdn[2]
    x, z = (_randn(rows, head, dtype=dtype, device=device) for _ in range(2))
    w = _randn(head, dtype=dtype, device=device)
    gated = compare(gated_rms_norm_triton(x, z, w, 1e-6), gated_rms_norm_torch(x, z, w, 1e-6, None, True), *tol)
    width = 8 * head
    x, z = (_randn(rows // 8, width, dtype=dtype, device=device) for _ in range(2))
    w = _randn(width, dtype=dtype, device=device)
    grouped = compare(
        gated_rms_norm_triton(x, z, w, 1e-5, width // 8, False),
        gated_rms_norm_torch(x, z, w, 1e-5, width // 8, False),
        *tol,
    )
    w = _randn(width, dtype=dtype, device=device) * 0.1
    plain = compare(rms_norm_triton(x, w, 1e-6, True), rms_norm_torch(x, w, 1e-6, True), *tol)
    return worst(gated, grouped, plain), cuda_ms(lambda: gated_rms_norm_triton(x, z, w, 1e-5))


def attention_case(
    seqs: list[tuple[int, int]],
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    impl: str = "triton",
    window: int | None = None,
) -> Result:
    """Triton (or FlashInfer) paged attention against the torch path, on the same device; the
    pools must receive exactly the same K/V. ``window``: a sliding window (Triton only)."""
    from kernels.attention.reference import paged_attention_torch

    if impl == "flashinfer":
        from kernels.attention.flashinfer_backend import paged_attention_flashinfer as fn
    else:
        from kernels.attention.triton_paged import paged_attention_triton as fn
    h_q, h_kv, dim = heads
    case = with_dtype(build_case(seqs, 16, h_q, h_kv, seed=dim, head_dim=dim), dtype)
    scale = dim**-0.5
    out, k_pool, v_pool = run_paged(fn, case, scale, device, window)
    want, want_k, want_v = run_paged(paged_attention_torch, case, scale, device, window)
    res = worst(
        compare(out, want, *TOL["exact"][dtype]), compare(k_pool, want_k, 0.0, 0.0), compare(v_pool, want_v, 0.0, 0.0)
    )
    args = {
        n: case[n].to(device)
        for n in ("q", "k", "v", "k_pool", "v_pool", "out_loc", "page_table", "cu_seqlens", "seq_lens")
    }
    extra = {} if window is None else {"window": window}
    return res, cuda_ms(lambda: fn(**args, page_size=16, scale=scale, **extra))


def attention_graph_case(seqs: list[tuple[int, int]], heads: tuple[int, int, int], device: torch.device) -> Result:
    """A decode step of the Triton kernel captured in a CUDA graph, replayed on new queries,
    equals the eager call: the kernel needs no host sync (on CPU: the eager call only)."""
    from kernels.attention.triton_paged import paged_attention_triton

    h_q, h_kv, dim = heads
    case = with_dtype(build_case(seqs, 16, h_q, h_kv, seed=7, head_dim=dim), torch.bfloat16)
    args = {
        n: case[n].clone().to(device)
        for n in ("q", "k", "v", "k_pool", "v_pool", "out_loc", "page_table", "cu_seqlens", "seq_lens")
    }

    def call() -> torch.Tensor:
        return paged_attention_triton(**args, page_size=16, scale=dim**-0.5)

    if device.type != "cuda":
        return compare(call(), call(), 0.0, 0.0), None
    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    args["q"].copy_(torch.randn_like(args["q"]))
    graph.replay()
    torch.cuda.synchronize()
    return compare(out.clone(), call(), 0.0, 0.0), cuda_ms(graph.replay)


Check = tuple[str, list[torch.dtype], Callable[[torch.dtype], Result]]


def checks(sz: KernelSizes, device: torch.device) -> list[Check]:
    both, bf16 = [torch.bfloat16, torch.float32], [torch.bfloat16]
    gdn, (ssd_heads, ssd_p, ssd_n) = sz.gdn, sz.ssd
    grid_heads, groups = (128, 8) if sz is FULL else (ssd_heads, 2)
    out: list[Check] = [
        (
            "gdn varlen (chunked + recurrent, snapshots)",
            both,
            lambda dt: gdn_case(_mixed(sz, 1, device), gdn, dt, device),
        ),
        (
            f"gdn decode {sz.grid_gdn_decodes} seqs x {gdn[0]} heads (grid axis 0)",
            bf16,
            lambda dt: gdn_case(_plain([1] * sz.grid_gdn_decodes, 4, device), gdn, dt, device),
        ),
        ("ssd varlen, 1 group", both, lambda dt: ssd_case(_mixed(sz, 2, device), sz.ssd, 1, dt, device)),
        (f"ssd varlen, {groups} groups", bf16, lambda dt: ssd_case(_mixed(sz, 2, device), sz.ssd, groups, dt, device)),
        (
            f"ssd decode {sz.grid_ssd_decodes} seqs x {grid_heads} heads (grid axis 0)",
            bf16,
            lambda dt: ssd_case(
                _plain([1] * sz.grid_ssd_decodes, 5, device), (grid_heads, ssd_p, ssd_n // 2), 1, dt, device
            ),
        ),
        (
            f"ssd chunked {sz.grid_ssd_longs} seqs x {grid_heads} heads (grid axis 0)",
            bf16,
            lambda dt: ssd_case(
                _plain([17] * sz.grid_ssd_longs, 6, device), (grid_heads, ssd_p, ssd_n // 2), 1, dt, device
            ),
        ),
        (
            "mamba1 selective scan varlen (chunked + recurrent, snapshots)",
            both,
            lambda dt: mamba1_case(_mixed(sz, 7, device), sz.mamba1, dt, device),
        ),
        ("causal conv1d varlen + update", both, lambda dt: conv_case(sz, dt, device)),
        ("rms norms (gated, grouped, zero-centred)", both, lambda dt: norm_case(sz, dt, device)),
    ]
    for heads in sz.attention:
        for label, seqs in (("mixed", sz.attention_mixed), ("decode", sz.attention_decode)):
            out.append(
                (
                    f"attention triton {label} {heads[0]}q/{heads[1]}kv d{heads[2]}",
                    both,
                    lambda dt, s=seqs, h=heads: attention_case(s, h, dt, device),
                )
            )
    window = 256 if sz is FULL else 8
    out.append(
        (
            f"attention triton mixed, sliding window {window}",
            both,
            lambda dt: attention_case(sz.attention_mixed, sz.attention[0], dt, device, window=window),
        )
    )
    out += new_checks(
        FULL_NEW if sz is FULL else TOY_NEW,
        lambda seed: _mixed(sz, seed, device),
        sz.attention_mixed,
        sz.attention_decode,
        device,
        TOL,
        POOL_TOL,
    )
    out += checks_2026(
        FULL_2026 if sz is FULL else TOY_2026, lambda seed: _mixed(sz, seed, device), mamba1_case, device, TOL, POOL_TOL
    )
    out.append(
        (
            "attention triton decode, CUDA graph replay = eager",
            bf16,
            lambda dt: attention_graph_case(sz.attention_decode, sz.attention[0], device),
        )
    )
    if device.type == "cuda" and has_flashinfer():
        for heads in [h for h in sz.attention if h[2] in backend.FLASHINFER_HEAD_DIMS]:
            for label, seqs in (("mixed", sz.attention_mixed), ("decode", sz.attention_decode)):
                out.append(
                    (
                        f"attention flashinfer {label} {heads[0]}q/{heads[1]}kv d{heads[2]}",
                        bf16,
                        lambda dt, s=seqs, h=heads: attention_case(s, h, dt, device, impl="flashinfer"),
                    )
                )
    return out


def run(sz: KernelSizes, device: torch.device, report: Report, deadline: Deadline) -> None:
    """Every check x dtype as one report row; an exception or the deadline fails the row."""
    for name, dtypes, fn in checks(sz, device):
        for dtype in dtypes:
            label = str(dtype).replace("torch.", "")
            if deadline.passed():
                report.row(name, label, None, None, "skipped: stage time limit", None, ok=False)
                continue
            torch.manual_seed(0)
            try:
                res, ms = fn(dtype)
            except Exception as exc:  # report it and go on with the next check
                traceback.print_exc()
                report.row(name, label, None, None, f"{type(exc).__name__}: {exc}"[:160], None, ok=False)
                continue
            report.row(name, label, res.max_err, _tol_label(name, dtype), res.ok, ms, ok=res.ok)
    if device.type == "cuda" and not has_flashinfer():
        report.note("FlashInfer is not installed: its rows are left out (the Triton kernel is the attention path).")


def _tol_label(name: str, dtype: torch.dtype) -> str:
    if name.startswith("indexer select"):
        return SELECT_TOL_LABEL
    kind = (
        "gdn"
        if name.startswith(("gdn", "kda"))
        else "ssd"
        if name.startswith(("ssd", "lightning"))
        else "mamba1"
        if name.startswith(("mamba1", "rglru"))
        else "exact"
    )
    rtol, atol = TOL[kind][dtype]
    return f"{rtol:g}/{atol:g}"


COLUMNS = ["check", "dtype", "max abs err", "rtol/atol", "result", "kernel ms"]
