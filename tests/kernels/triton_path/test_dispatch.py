"""The backend switch: parsing, overrides, and which implementation each public op runs."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

import kernels.attention
import kernels.conv1d
import kernels.gdn
import kernels.norm
import kernels.rglru
import kernels.selective_scan
import kernels.ssd
from kernels import backend, fused_cpu
from kernels.recurrent_batch import RecurrentBatch

# The CPU rules: on a CUDA machine "auto" picks Triton and forced Triton needs no interpreter.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU dispatch rules")


def test_parse_and_restore():
    assert backend.parse_backend(" Triton ") is backend.Backend.TRITON
    with pytest.raises(ValueError, match="'cuda'"):
        backend.parse_backend("cuda")
    before = backend.get_backend()
    with backend.use_backend("torch"):
        assert backend.get_backend() is backend.Backend.TORCH
        with backend.use_backend(backend.Backend.TRITON):
            assert backend.get_backend() is backend.Backend.TRITON
        assert backend.get_backend() is backend.Backend.TORCH
    assert backend.get_backend() is before


def test_env_var_read_at_import(monkeypatch):
    try:
        monkeypatch.setenv(backend.ENV_VAR, "torch")
        assert importlib.reload(backend).get_backend() is backend.Backend.TORCH
        monkeypatch.setenv(backend.ENV_VAR, "fast")
        with pytest.raises(ValueError, match="'fast'"):
            importlib.reload(backend)
    finally:
        monkeypatch.delenv(backend.ENV_VAR)
        importlib.reload(backend)
    assert backend.get_backend() is backend.Backend.AUTO


@cpu_only
def test_cpu_rules(monkeypatch):
    t = torch.zeros(2)
    monkeypatch.setattr(backend, "flashinfer_available", lambda: True)
    with backend.use_backend("auto"):
        assert not backend.use_triton(t)
        assert backend.attention_impl(t) is backend.AttentionImpl.TORCH
    with backend.use_backend("triton"):
        assert backend.use_triton(t)
        assert backend.attention_impl(t) is backend.AttentionImpl.TRITON  # FlashInfer never off CUDA
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            backend.use_triton(t)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            backend.attention_impl(t)


def _cuda_query(dtype: torch.dtype, head_dim: int) -> SimpleNamespace:
    """What ``attention_impl`` reads of a query, as a CUDA tensor would show it."""
    return SimpleNamespace(is_cuda=True, dtype=dtype, shape=(3, 16, head_dim))


@pytest.mark.parametrize("installed", [True, False])
def test_cuda_attention_rules(installed, monkeypatch):
    """On CUDA: FlashInfer only for bf16/fp16 at a head dim it is built for, when installed
    and not overridden; the Triton kernel for everything else (the shipped tiny model's head
    dim 32, fp32, FlashInfer missing); torch only when asked for."""
    monkeypatch.setattr(backend, "flashinfer_available", lambda: installed)
    flashinfer = backend.AttentionImpl.FLASHINFER if installed else backend.AttentionImpl.TRITON
    want = {
        (torch.bfloat16, 256): flashinfer,
        (torch.float16, 128): flashinfer,
        (torch.bfloat16, 64): flashinfer,
        (torch.bfloat16, 32): backend.AttentionImpl.TRITON,
        (torch.bfloat16, 80): backend.AttentionImpl.TRITON,
        (torch.float32, 128): backend.AttentionImpl.TRITON,
    }
    with backend.use_backend("auto"):
        got = {key: backend.attention_impl(_cuda_query(*key)) for key in want}
        # a sliding window (Lfm3) never takes FlashInfer
        assert backend.attention_impl(_cuda_query(torch.bfloat16, 128), windowed=True) is backend.AttentionImpl.TRITON
    assert got == want
    with backend.use_backend("triton"):
        assert backend.attention_impl(_cuda_query(torch.bfloat16, 128)) is backend.AttentionImpl.TRITON
    with backend.use_backend("torch"):
        assert backend.attention_impl(_cuda_query(torch.bfloat16, 128)) is backend.AttentionImpl.TORCH
    # a compiled step (dynamo tracing) never takes FlashInfer: its host-side plans cannot be traced
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with backend.use_backend("auto"):
        assert backend.attention_impl(_cuda_query(torch.bfloat16, 128)) is backend.AttentionImpl.TRITON


def _boom(*args, **kwargs):
    raise AssertionError("the torch reference ran")


def _calls():
    """(package, torch function name, a call of the public op) for every dispatched op."""
    cu, slot, init = (
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([True]),
    )
    r, seqs = torch.randn, RecurrentBatch(cu, slot, init)
    return [
        (
            kernels.gdn,
            "gated_delta_rule_torch",
            lambda: kernels.gdn.gated_delta_rule(
                r(3, 1, 16), r(3, 1, 16), r(3, 2, 16), -r(3, 2).abs(), r(3, 2).sigmoid(), r(2, 2, 16, 16), seqs
            ),
        ),
        (
            kernels.ssd,
            "ssd_torch",
            lambda: kernels.ssd.ssd_scan(
                r(3, 2, 16), r(3, 2), -r(2).abs(), r(3, 1, 16), r(3, 1, 16), r(2), r(2), r(2, 2, 16, 16), seqs
            ),
        ),
        (
            kernels.selective_scan,
            "mamba_selective_scan_torch",
            lambda: kernels.selective_scan.mamba_selective_scan(
                r(3, 16), r(3, 16), -r(16, 4).abs(), r(3, 4), r(3, 4), r(16), r(16), r(2, 16, 4), seqs
            ),
        ),
        (
            kernels.selective_scan,
            "mamba_selective_scan_torch",
            lambda: kernels.selective_scan.mamba_selective_scan(
                r(1, 16),
                r(1, 16),
                -r(16, 4).abs(),
                r(1, 4),
                r(1, 4),
                r(16),
                None,
                r(2, 16, 4),
                RecurrentBatch.decode(slot),
            ),
        ),
        (
            kernels.conv1d,
            "causal_conv1d_torch",
            lambda: kernels.conv1d.causal_conv1d(r(3, 16), r(16, 4), None, r(2, 16, 3), seqs),
        ),
        (
            kernels.conv1d,
            "causal_conv1d_torch",
            lambda: kernels.conv1d.causal_conv1d(r(1, 16), r(16, 4), None, r(2, 16, 3), RecurrentBatch.decode(slot)),
        ),
        (
            kernels.rglru,
            "rglru_torch",
            lambda: kernels.rglru.rg_lru(
                r(3, 16), r(3, 16), r(3, 16), -r(16).abs(), torch.tensor([True, False, False]), r(2, 16), seqs
            ),
        ),
        (kernels.norm, "rms_norm_torch", lambda: kernels.norm.rms_norm(r(3, 16), r(16), 1e-6)),
        (kernels.norm, "gated_rms_norm_torch", lambda: kernels.norm.gated_rms_norm(r(3, 16), r(3, 16), r(16), 1e-6)),
        (
            kernels.attention,
            "paged_attention_torch",
            lambda: kernels.attention.paged_attention(
                r(3, 4, 16),
                r(3, 2, 16),
                r(3, 2, 16),
                r(8, 2, 16),
                r(8, 2, 16),
                torch.tensor([4, 5, 6]),
                torch.tensor([[1]], dtype=torch.int32),
                cu,
                torch.tensor([3], dtype=torch.int32),
                4,
                0.25,
            ),
        ),
    ]


# Ops whose CPU path under ``auto`` is a C++ loop (``backend.use_native``), not the reference.
NATIVE = {
    "gated_delta_rule_torch": "gated_delta_rule_cpu",
    "causal_conv1d_torch": "causal_conv1d_cpu",
    "ssd_torch": "ssd_cpu",
}
# Norms whose eager CPU fp32 path under ``auto`` is a fused C++ kernel (``kernels.fused_cpu``).
FUSED = {"rms_norm_torch": "rms_norm", "gated_rms_norm_torch": "gated_rms_norm"}


def _boom_native(*args, **kwargs):
    raise AssertionError("the native loop ran")


@cpu_only
@pytest.mark.parametrize("index", range(len(_calls())))
def test_each_op_follows_the_switch(index, monkeypatch):
    module, name, call = _calls()[index]
    monkeypatch.setattr(module, name, _boom)
    if name in NATIVE:
        monkeypatch.setattr(module, NATIVE[name], _boom_native)
    if name in FUSED:
        monkeypatch.setattr(fused_cpu, FUSED[name], _boom_native)
    with backend.use_backend("triton"):
        assert call().isfinite().all()  # ran the Triton kernel
    with backend.use_backend("torch"), pytest.raises(AssertionError, match="reference ran"):
        call()
    with (
        backend.use_backend("auto"),
        pytest.raises(  # CPU tensors: the reference or a C++ loop
            AssertionError, match="native loop ran" if name in NATIVE or name in FUSED else "reference ran"
        ),
    ):
        call()
