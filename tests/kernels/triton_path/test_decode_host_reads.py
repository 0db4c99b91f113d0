"""A decode step on the Triton path reads nothing back to the host, so a CUDA graph can hold it
(what ``tests/gpu/bench_decode.py`` captures on the GPU), checked here on the CPU with the
interpreter: every kernel of a dense Qwen3-Next decode step (GDN update, conv update, norms,
paged attention), from the first step on: a decode's launch plans come from shapes
(``kernels.chunking.uniform_plan``), so neither a captured graph nor an eager step syncs."""

from __future__ import annotations

import torch

from kernels import backend, native_ops
from tests.gpu import bench_decode
from tests.gpu.host_reads import host_reads


def _decode_step(dims: dict):
    bench = bench_decode.build(dims, torch.device("cpu"), torch.float32)
    step, _, _ = bench_decode.decode_step(bench, 3, torch.device("cpu"), torch.float32)
    return step


def test_dense_decode_step_has_no_host_reads():
    step = _decode_step(bench_decode.TOY)
    with backend.use_backend("triton"), torch.inference_mode():
        assert host_reads(step) == []  # the first step too: nothing memoised


def test_the_detector_sees_host_reads(monkeypatch):
    """The MoE layer (its Python expert loop: the C++ one reads in C++, unseen) reads its
    per-expert counts on the host: the detector must say so."""
    monkeypatch.setitem(native_ops._state, "loaded", False)
    moe = dict(bench_decode.TOY, mlp_only_layers=[])
    step = _decode_step(moe)
    with backend.use_backend("triton"), torch.inference_mode():
        step()
        reads = host_reads(step)
    assert reads and all("moe_experts.py" in r for r in reads), reads
    assert any(r.startswith("tolist") for r in reads)
