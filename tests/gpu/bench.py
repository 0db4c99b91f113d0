"""Speed table of the GPU path: each kernel against its torch reference, then the engine's
decode throughput on a ~1B-parameter random-weight Qwen3-Next against the memory-bandwidth
bound.

    python tests/gpu/bench.py                 # on the H200 (run_device_checks.sh calls this)
    TRITON_INTERPRET=1 python tests/gpu/bench.py --smoke   # CPU: tiny sizes, catches bugs;
                                                            # the timings mean nothing

Bandwidth columns count the bytes a kernel must move at least once (recurrent states read
and written, KV read, activations in and out) over its time, against ``--bandwidth-gbs``
(H200: 4.8 TB/s).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels import backend  # noqa: E402
from tests.gpu.common import has_flashinfer, varlen_meta, verify_snapshots  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    batch: int          # decode batch
    prefill: list[int]  # prefill lengths
    heads: int          # GDN value heads / SSD heads (SSD uses 4x)
    dim: int            # GDN K = V; SSD P = dim // 2, N = dim
    conv_dim: int
    attn: tuple[int, int, int, int]    # Hq, Hkv, head dim, decode context


FULL = Sizes(256, [2048] * 4, 32, 128, 8192, (16, 2, 256, 4096))
SMOKE = Sizes(2, [40], 2, 16, 32, (4, 2, 64, 24))


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean milliseconds per call after one warm-up call (which also compiles)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


class Table:
    def __init__(self, bandwidth_gbs: float) -> None:
        self.bandwidth = bandwidth_gbs
        print(f"{'op':<34}{'torch ms':>10}{'triton ms':>11}{'speedup':>9}{'GB/s':>9}{'% bw':>7}")

    def row(self, name: str, ref_ms: float, new_ms: float, nbytes: float | None) -> None:
        gbs = nbytes / new_ms / 1e6 if nbytes else None
        bw = f"{gbs:9.0f}{100 * gbs / self.bandwidth:6.0f}%" if gbs else f"{'-':>9}{'-':>7}"
        print(f"{name:<34}{ref_ms:10.3f}{new_ms:11.3f}{ref_ms / new_ms:8.1f}x{bw}", flush=True)


def both(ref: Callable[[], object], new: Callable[[], object], device: torch.device,
         iters: int) -> tuple[float, float]:
    with backend.use_backend("torch"):
        ref_ms = timed(ref, device, iters)
    with backend.use_backend("triton"):
        new_ms = timed(new, device, iters)
    return ref_ms, new_ms


def bench_gdn(sz: Sizes, device: torch.device, table: Table, iters: int) -> None:
    from kernels.gdn import gated_delta_rule_varlen

    for name, lens, verify in (("gdn decode", [1] * sz.batch, False),
                               ("gdn verify 1+3 (per-token states)", [4] * max(1, sz.batch // 4),
                                True),
                               ("gdn prefill", sz.prefill, False)):
        snaps = verify_snapshots(lens, 4, len(lens) + 1) if verify else None
        cu, slots, init, dst, num_slots = varlen_meta(lens, len(lens), snaps, init_prob=1.0,
                                                      device=device.type)
        t, h, d = sum(lens), sz.heads, sz.dim
        x = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
        q, k, v = x(t, h, d), x(t, h, d), x(t, h, d)
        g, beta = -torch.rand(t, h, device=device) * 0.3, torch.rand(t, h, device=device)
        pool = torch.randn(num_slots, h, d, d, device=device) * 0.1
        call = lambda: gated_delta_rule_varlen(q, k, v, g, beta, pool, cu, slots, init,  # noqa
                                               state_dst_slots=dst)
        state = h * d * d * 4
        moved = len(lens) * state * (2 + (4 if verify else 0)) if len(lens) > 4 else None
        table.row(name, *both(call, call, device, iters), moved)


def bench_ssd(sz: Sizes, device: torch.device, table: Table, iters: int) -> None:
    from kernels.ssd import ssd_varlen

    heads, p_dim, n_dim = 4 * sz.heads, sz.dim // 2, sz.dim
    for name, lens in (("ssd decode", [1] * sz.batch), ("ssd prefill", sz.prefill)):
        cu, slots, init, dst, num_slots = varlen_meta(lens, len(lens), init_prob=1.0,
                                                      device=device.type)
        t = sum(lens)
        x = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
        args = (x(t, heads, p_dim), x(t, heads) - 2, -torch.rand(heads, device=device) * 8 - 1,
                x(t, 1, n_dim), x(t, 1, n_dim), x(heads), x(heads))
        pool = torch.randn(num_slots, heads, p_dim, n_dim, device=device) * 0.1
        call = lambda: ssd_varlen(*args, pool, cu, slots, init)  # noqa: E731
        moved = len(lens) * heads * p_dim * n_dim * 4 * 2 if len(lens) > 4 else None
        table.row(name, *both(call, call, device, iters), moved)


def bench_conv_and_norm(sz: Sizes, device: torch.device, table: Table, iters: int) -> None:
    from kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen
    from kernels.norm import gated_rms_norm

    b, dim = sz.batch, sz.conv_dim
    bf = dict(device=device, dtype=torch.bfloat16)
    weight, pool = torch.randn(dim, 4, **bf), torch.randn(b + 1, dim, 3, **bf)
    slots = torch.arange(1, b + 1, dtype=torch.int32, device=device)
    x1 = torch.randn(b, dim, **bf)
    call = lambda: causal_conv1d_update(x1, weight, None, pool, slots)  # noqa: E731
    table.row("conv1d update (decode)", *both(call, call, device, iters), b * dim * 2 * (3 * 2 + 2))
    lens = sz.prefill
    cu, slots2, init, _, num_slots = varlen_meta(lens, len(lens), device=device.type)
    xt, pool2 = torch.randn(sum(lens), dim, **bf), torch.randn(num_slots, dim, 3, **bf)
    call = lambda: causal_conv1d_varlen(xt, weight, None, pool2, cu, slots2, init)  # noqa: E731
    table.row("conv1d varlen (prefill)", *both(call, call, device, iters), xt.numel() * 2 * 2)
    rows = torch.randn(sum(lens) * sz.heads, sz.dim, **bf)
    gate, w = torch.randn_like(rows), torch.randn(sz.dim, **bf)
    call = lambda: gated_rms_norm(rows, gate, w, 1e-6)  # noqa: E731
    table.row("gated rms norm (gdn, prefill)", *both(call, call, device, iters),
              rows.numel() * 2 * 3)


def bench_attention(sz: Sizes, device: torch.device, table: Table, iters: int) -> None:
    from kernels.attention.flashinfer_backend import paged_attention_flashinfer
    from kernels.attention.reference import paged_attention_torch
    from tests.gpu.test_attention_gpu import build

    h_q, h_kv, d, ctx = sz.attn
    for name, seqs in (("attention decode (flashinfer)", [(ctx - 1, 1)] * (sz.batch // 4)),
                       ("attention prefill (flashinfer)", [(0, n) for n in sz.prefill])):
        case = build(seqs, h_q, h_kv, d, seed=0)
        ref = lambda: paged_attention_torch(**case)  # noqa: E731
        new = lambda: paged_attention_flashinfer(**case)  # noqa: E731
        kv = sum(p + n for p, n in seqs) * h_kv * d * 2 * 2
        table.row(name, *both(ref, new, device, iters), kv if seqs[0][1] == 1 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter)")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not backend.interpreting():
        sys.exit("no CUDA: run with TRITON_INTERPRET=1 and --smoke")
    sz, iters = (SMOKE, 1) if args.smoke else (FULL, args.iters)
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
          f"torch {torch.__version__}; sizes {'smoke' if args.smoke else 'full'}")
    table = Table(args.bandwidth_gbs)
    bench_gdn(sz, device, table, iters)
    bench_ssd(sz, device, table, iters)
    bench_conv_and_norm(sz, device, table, iters)
    if device.type == "cuda" and has_flashinfer():
        bench_attention(sz, device, table, iters)
    else:
        print("attention: skipped (FlashInfer needs CUDA and the gpu extra)")
    if not args.skip_model:
        from tests.gpu.bench_model import bench_decode_throughput
        bench_decode_throughput(device, args.smoke, args.bandwidth_gbs)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
