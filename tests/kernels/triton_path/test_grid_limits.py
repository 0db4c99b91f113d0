"""Every Triton kernel's launch grid stays within CUDA's limits at real batch sizes.

Each ``@triton.jit`` kernel of ``kernels/`` is replaced by a recorder that keeps its launch
grid and runs nothing; the public launchers are then called with batches past the old limit
(1,024 decodes and 520 long prefills of a 128-head model: 131,072 and 66,560 programs per
sequence-x-head grid) and tiny feature dims, so no GPU and no kernel run is needed. The
interpreter tests of the same folder check that the kernels read the grids this way round.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

import kernels
from kernels.launch_grid import CUDA_MAX_GRID
from kernels.recurrent_batch import RecurrentBatch

HEADS = 128
LENS = [1] * 1024 + [17] * 520  # the short (recurrent) and the long (chunked) paths


class Recorder:
    def __init__(self, name: str, grids: list[tuple[str, tuple[int, ...]]]) -> None:
        self.name, self.grids = name, grids

    def __getitem__(self, grid):
        self.grids.append((self.name, tuple(grid)))
        return lambda *args, **kwargs: None


def _is_jit(obj) -> bool:
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction")


def _kernel_modules():
    names = [
        m.name
        for m in pkgutil.walk_packages(kernels.__path__, "kernels.")
        if m.name.rsplit(".", 1)[-1].startswith("triton_")
    ]
    return [importlib.import_module(n) for n in names]


@pytest.fixture
def grids(monkeypatch) -> tuple[list[tuple[str, tuple[int, ...]]], set[str]]:
    """(recorded launches, every kernel's name): kernels are the jit functions named *_kernel."""
    recorded: list[tuple[str, tuple[int, ...]]] = []
    names: set[str] = set()
    for module in _kernel_modules():
        for attr, obj in list(vars(module).items()):
            if _is_jit(obj) and attr.endswith("_kernel"):
                names.add(attr)
                monkeypatch.setattr(module, attr, Recorder(attr, recorded))
    return recorded, names


def _varlen():
    cu = torch.zeros(len(LENS) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(LENS, dtype=torch.int32), 0)
    slots = torch.arange(1, len(LENS) + 1, dtype=torch.int32)
    dst = torch.zeros(int(cu[-1]), dtype=torch.int32)
    dst[-1] = len(LENS) + 1  # one snapshot: the conv snapshot launch too
    return cu, slots, torch.ones(len(LENS), dtype=torch.bool), dst, len(LENS) + 2


def _launch_everything() -> None:
    from kernels.attention.triton_paged import paged_attention_triton
    from kernels.conv1d.triton_conv import causal_conv1d_update_triton, causal_conv1d_varlen_triton
    from kernels.fp8.triton_block import block_fp8_matmul
    from kernels.gdn.triton_varlen import gated_delta_rule_varlen_triton
    from kernels.indexer.triton_select import select_positions_triton
    from kernels.indexer.triton_sparse import sparse_attention_triton
    from kernels.kda.triton_varlen import kda_varlen_triton
    from kernels.mla.triton_paged import mla_attention_triton
    from kernels.norm.triton_norm import gated_rms_norm_triton, rms_norm_triton
    from kernels.rglru.triton_scan import rglru_triton
    from kernels.selective_scan.triton_varlen import selective_scan_varlen_triton
    from kernels.ssd.triton_varlen import ssd_varlen_triton

    cu, slots, init, dst, num_slots = _varlen()
    t, r, seqs = int(cu[-1]), torch.randn, RecurrentBatch(cu, slots, init, dst)
    gated_delta_rule_varlen_triton(
        r(t, 16, 2), r(t, 16, 2), r(t, HEADS, 2), r(t, HEADS), r(t, HEADS), r(num_slots, HEADS, 2, 2), seqs
    )
    kda_varlen_triton(
        r(t, HEADS, 2),
        r(t, HEADS, 2),
        r(t, HEADS, 2),
        -r(t, HEADS, 2).abs(),
        r(t, HEADS),
        r(num_slots, HEADS, 2, 2),
        seqs,
    )
    ssd_varlen_triton(
        r(t, HEADS, 2),
        r(t, HEADS),
        r(HEADS),
        r(t, 1, 2),
        r(t, 1, 2),
        r(HEADS),
        r(HEADS),
        r(num_slots, HEADS, 2, 2),
        seqs,
    )
    causal_conv1d_varlen_triton(r(t, 16), r(16, 4), None, r(num_slots, 16, 3), cu, slots, init, "silu", dst)
    channels = 8192  # Jamba's d_inner: channel blocks on axis 1
    selective_scan_varlen_triton(
        r(t, channels),
        r(t, channels),
        r(channels, 2),
        r(t, 2),
        r(t, 2),
        r(channels),
        r(channels),
        r(num_slots, channels, 2),
        seqs,
    )
    causal_conv1d_update_triton(r(len(LENS), 16), r(16, 4), None, r(num_slots, 16, 3), slots)
    lru = 2560  # recurrentgemma-2b's lru_width: channel blocks on axis 1
    rglru_triton(r(t, lru), r(t, lru), r(t, lru), r(lru), torch.zeros(t, dtype=torch.bool), r(num_slots, lru), seqs)
    rms_norm_triton(r(t * HEADS, 2), r(2), 1e-6)
    gated_rms_norm_triton(r(t, 16), r(t, 16), r(16), 1e-6, 2)
    page_size, ctx = 16, [n + 15 for n in LENS]
    table = torch.arange(1, 2 * len(LENS) + 1, dtype=torch.int32).view(len(LENS), 2)
    paged_attention_triton(
        r(t, HEADS, 16),
        r(t, 8, 16),
        r(t, 8, 16),
        r(64, 8, 16),
        r(64, 8, 16),
        torch.zeros(t, dtype=torch.int64),
        table,
        cu,
        torch.tensor(ctx, dtype=torch.int32),
        page_size,
        0.25,
    )
    mla_attention_triton(
        r(t, HEADS, 24),
        r(t, 24),
        r(64, 1, 24),
        torch.zeros(t, dtype=torch.int64),
        table,
        cu,
        torch.tensor(ctx, dtype=torch.int32),
        page_size,
        0.25,
        16,
    )
    lens = torch.tensor(ctx, dtype=torch.int32)
    picked = select_positions_triton(r(t, HEADS, 16), None, r(len(LENS), 2, 16), cu, lens, 4, 2)
    sparse_attention_triton(r(t, HEADS, 16), r(64, 8, 16), r(64, 8, 16), picked, table, cu, lens, page_size, 0.25)
    rows, cols, fp8 = 4096, 8192, torch.float8_e4m3fn  # rows of tokens on axis 0, output columns on axis 1
    block_fp8_matmul(
        torch.empty(rows, 128, dtype=fp8),
        r(rows, 1),
        torch.empty(cols, 128, dtype=fp8),
        r(64, 1),
        (128, 128),
        torch.bfloat16,
    )


def test_every_launch_within_cuda_limits(grids):
    recorded, names = grids
    _launch_everything()
    launched = {name for name, _ in recorded}
    assert launched == names, f"kernels never launched here: {sorted(names - launched)}"
    for name, grid in recorded:
        assert len(grid) <= 3 and all(0 <= n <= cap for n, cap in zip(grid, CUDA_MAX_GRID)), (
            f"{name}: grid {grid} exceeds {CUDA_MAX_GRID}"
        )
    seq_head = {
        name: grid
        for name, grid in recorded
        if name
        in (
            "gdn_recurrent_kernel",
            "gdn_chunk_state_kernel",
            "ssd_recurrent_kernel",
            "ssd_chunk_state_kernel",
            "kda_recurrent_kernel",
            "kda_chunk_state_kernel",
        )
    }
    assert len(seq_head) == 6
    # the case is big enough to matter: each of these would not fit on axis 1
    assert all(grid[0] > CUDA_MAX_GRID[1] for grid in seq_head.values()), seq_head
