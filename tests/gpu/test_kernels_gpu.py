"""Every Triton kernel against its torch reference on CUDA, at real model sizes and dtypes.

One mixed varlen batch per op: decodes, speculative verifies (a snapshot after every draft
token), and long prefills with prefix-cache snapshots mid-sequence; bf16 activations, fp32
recurrent pools. fp32 ``tl.dot`` runs in tf32 on the GPU, hence the tolerances.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.common import close, mixed_lens, varlen_meta, verify_snapshots

VERIFY_LEN = 4


def _batch(prefills: list[int], seed: int):
    lens = mixed_lens(num_decode=32, num_verify=8, verify_len=VERIFY_LEN, prefills=prefills)
    live = len(lens) + 8
    snaps = verify_snapshots(lens, VERIFY_LEN, first_slot=live + 1)
    start = sum(lens[:-len(prefills)])                  # prefix-cache checkpoints mid-prefill
    snaps.update({start + 255: max(snaps.values()) + 1, start + 511: max(snaps.values()) + 2})
    return lens, varlen_meta(lens, live, snaps, seed=seed)


@pytest.mark.parametrize("num_k_heads", [16, 32])
def test_gdn_qwen3_next_sizes(num_k_heads):
    from kernels.gdn.reference import gated_delta_rule_varlen_torch
    from kernels.gdn.triton_varlen import gated_delta_rule_varlen_triton

    lens, (cu, slots, has_init, dst, num_slots) = _batch([700, 129], seed=1)
    num_tokens, heads, dim = sum(lens), 32, 128
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(num_tokens, num_k_heads, dim, device=dev, dtype=bf16)
    k = torch.randn(num_tokens, num_k_heads, dim, device=dev, dtype=bf16)
    v = torch.randn(num_tokens, heads, dim, device=dev, dtype=bf16)
    g = -torch.rand(num_tokens, heads, device=dev) * 0.3
    beta = torch.rand(num_tokens, heads, device=dev, dtype=bf16)
    pool = torch.randn(num_slots, heads, dim, dim, device=dev) * 0.1
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref = gated_delta_rule_varlen_torch(q, k, v, g, beta, ref_pool, cu, slots, has_init, None,
                                        True, 64, dst)
    out = gated_delta_rule_varlen_triton(q, k, v, g, beta, tri_pool, cu, slots, has_init,
                                         state_dst_slots=dst)
    close(out, ref, 2e-2, 2e-2, "gdn output")
    close(tri_pool, ref_pool, 1e-2, 1e-2, "gdn pool (live + snapshot slots)")


@pytest.mark.parametrize("groups", [1, 8])
def test_ssd_mamba2_sizes(groups):
    from kernels.ssd.reference import ssd_varlen_torch
    from kernels.ssd.triton_varlen import ssd_varlen_triton

    lens, (cu, slots, has_init, dst, num_slots) = _batch([600, 300], seed=2)
    num_tokens, heads, head_dim, state = sum(lens), 128, 64, 128
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(num_tokens, heads, head_dim, device=dev, dtype=bf16)
    dt = torch.randn(num_tokens, heads, device=dev, dtype=bf16) - 2.0
    A = -torch.rand(heads, device=dev) * 8 - 1.0
    B = torch.randn(num_tokens, groups, state, device=dev, dtype=bf16)
    C = torch.randn(num_tokens, groups, state, device=dev, dtype=bf16)
    D = torch.randn(heads, device=dev, dtype=bf16)
    dt_bias = torch.randn(heads, device=dev, dtype=bf16) * 0.5
    pool = torch.randn(num_slots, heads, head_dim, state, device=dev) * 0.1
    ref_pool, tri_pool = pool.clone(), pool.clone()
    args = (x, dt, A, B, C, D, dt_bias)
    ref = ssd_varlen_torch(*args, ref_pool, cu, slots, has_init, True, (0.0, float("inf")), 256,
                           dst)
    y = ssd_varlen_triton(*args, tri_pool, cu, slots, has_init, state_dst_slots=dst)
    close(y, ref, 2e-2, 5e-2, "ssd output")
    close(tri_pool, ref_pool, 1e-2, 1e-2, "ssd pool (live + snapshot slots)")


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_conv1d_gdn_width(pool_dtype):
    from kernels.conv1d.reference import causal_conv1d_update_torch, causal_conv1d_varlen_torch
    from kernels.conv1d.triton_conv import causal_conv1d_update_triton, causal_conv1d_varlen_triton

    lens, (cu, slots, has_init, dst, num_slots) = _batch([700, 129], seed=3)
    num_tokens, dim, width = sum(lens), 8192, 4
    dev, bf16 = "cuda", torch.bfloat16
    proj = torch.randn(num_tokens, dim + 2048, device=dev, dtype=bf16)
    x = proj[:, 1024:1024 + dim]                         # a column slice, as in the mixers
    weight = torch.randn(dim, width, device=dev, dtype=bf16) * 0.5
    pool = torch.randn(num_slots, dim, width - 1, device=dev).to(pool_dtype)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref = causal_conv1d_varlen_torch(x, weight, None, ref_pool, cu, slots, has_init, "silu", dst)
    out = causal_conv1d_varlen_triton(x, weight, None, tri_pool, cu, slots, has_init, "silu", dst)
    close(out, ref, 2e-2, 2e-2, "conv output")
    assert torch.equal(tri_pool, ref_pool)               # states are copies of inputs: exact
    one = torch.randn(slots.shape[0], dim, device=dev, dtype=bf16)     # one decode step
    ref = causal_conv1d_update_torch(one, weight, None, ref_pool, slots, "silu")
    out = causal_conv1d_update_triton(one, weight, None, tri_pool, slots, "silu")
    close(out, ref, 2e-2, 2e-2, "conv update output")
    assert torch.equal(tri_pool, ref_pool)


def test_norms_model_sizes():
    from kernels.norm.reference import gated_rms_norm_torch, rms_norm_torch
    from kernels.norm.triton_norm import gated_rms_norm_triton, rms_norm_triton

    dev, bf16 = "cuda", torch.bfloat16
    x, z = (torch.randn(1024 * 32, 128, device=dev, dtype=bf16) for _ in range(2))
    w = torch.randn(128, device=dev, dtype=bf16)
    close(gated_rms_norm_triton(x, z, w, 1e-6), gated_rms_norm_torch(x, z, w, 1e-6, None, True),
          2e-2, 2e-2, "gdn gated norm")
    x, z = (torch.randn(1024, 8192, device=dev, dtype=bf16) for _ in range(2))
    w = torch.randn(8192, device=dev, dtype=bf16)
    close(gated_rms_norm_triton(x, z, w, 1e-5, 1024, False),
          gated_rms_norm_torch(x, z, w, 1e-5, 1024, False), 2e-2, 2e-2, "mamba2 grouped norm")
    x, w = torch.randn(1024, 2048, device=dev, dtype=bf16), torch.randn(2048, device=dev) * 0.1
    close(rms_norm_triton(x, w, 1e-6, True), rms_norm_torch(x, w, 1e-6, True), 2e-2, 2e-2,
          "zero-centred rms norm")
