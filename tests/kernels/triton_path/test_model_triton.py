"""Whole tiny models: greedy tokens with the Triton path forced equal the torch path.

Every op runs its Triton kernel, paged attention included, which the tests check by making
the torch references raise. The
prefix-cache test also makes the Triton kernels write mid-prompt snapshots
(``state_dst_slots``) that later requests resume from.
"""

from __future__ import annotations

import pytest
import torch

import kernels.attention
import kernels.chunking
import kernels.conv1d
import kernels.gdn
import kernels.kda
import kernels.mla
import kernels.norm
import kernels.rglru
import kernels.selective_scan
import kernels.ssd
from kernels import backend

PROMPTS = [
    "Hello there",
    "a",
    # > 16 tokens: the prefill takes the chunked kernels
    "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat by the door",
]
# The families that between them run every Triton kernel of TORCH_REFS: GDN (qwen3_next),
# SSD (granitemoehybrid), selective scan (jamba), KDA + MLA (kimi_linear), RG-LRU
# (recurrent_gemma); conv1d, the norms and paged attention in all of them. The other
# families run these tests in ``slow``.
KERNEL_FAMILIES = frozenset({"qwen3_next", "granitemoehybrid", "jamba", "kimi_linear", "recurrent_gemma"})
TORCH_REFS = [
    (kernels.gdn, "gated_delta_rule_torch"),
    (kernels.ssd, "ssd_torch"),
    (kernels.conv1d, "causal_conv1d_torch"),
    (kernels.norm, "rms_norm_torch"),
    (kernels.norm, "gated_rms_norm_torch"),
    (kernels.attention, "paged_attention_torch"),
    (kernels.selective_scan, "mamba_selective_scan_torch"),
    (kernels.kda, "kda_torch"),
    (kernels.mla, "mla_attention_torch"),
    (kernels.rglru, "rglru_torch"),
]


def make_llm(model_dir, device, **cache):
    LLM = pytest.importorskip("workers.llm").LLM  # the engine's deps may be missing (GPU box)
    return LLM(
        model=str(model_dir),
        device=device.type,
        dtype="float32",
        cache={"page_size": 4, "max_kv_tokens": 4096, **cache},
    )


def greedy(llm, prompts: list, one_by_one: bool = False):
    from workers.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    if one_by_one:
        outs = [llm.generate([p], params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    return [(out.token_ids, out.cached_tokens) for out in outs]


def greedy_tokens(model_dir, device) -> list[list[int]]:
    llm = make_llm(model_dir, device)
    assert len(llm.encode(PROMPTS[-1])) > 16
    return [tokens for tokens, _ in greedy(llm, PROMPTS)]


def _forbidden(*args, **kwargs):
    raise AssertionError("a torch reference ran on the forced Triton path")


@pytest.mark.core_families(families=KERNEL_FAMILIES)
def test_greedy_tokens_equal(tiny_model_dir, device, monkeypatch):
    with backend.use_backend("torch"):
        want = greedy_tokens(tiny_model_dir, device)
    for module, name in TORCH_REFS:
        monkeypatch.setattr(module, name, _forbidden)
    with backend.use_backend("triton"):
        got = greedy_tokens(tiny_model_dir, device)
    assert got == want
    assert len({t for seq in want for t in seq}) > 4  # not a collapsed, trivial output


@pytest.mark.core_families(families=KERNEL_FAMILIES)
def test_prefix_cache_snapshots_equal(tiny_model_dir, device, monkeypatch):
    """Checkpoints every 4 tokens mid-prompt, then prompts that resume from them."""
    stem = PROMPTS[-1]
    prompts = [stem, stem + " and then", stem + " or not"]
    cache = dict(mamba_strategy="extra_buffer", mamba_track_interval=4)
    with backend.use_backend("torch"):
        want = greedy(make_llm(tiny_model_dir, device, **cache), prompts, one_by_one=True)
    assert all(cached > 0 for _, cached in want[1:])  # the later prompts hit the cache

    from kernels.conv1d import triton_conv

    snapshots = []  # snapshot slots the scans' (and the conv's) launches saw
    plan, conv = kernels.chunking.launch_plan, triton_conv.causal_conv1d_varlen_triton

    def spy(cu_seqlens, state_dst_slots, *args):
        if state_dst_slots is not None:
            snapshots.append(int(torch.count_nonzero(state_dst_slots)))
        return plan(cu_seqlens, state_dst_slots, *args)

    def conv_spy(*args):  # a short-conv family has no scan: its conv writes them
        if args[-1] is not None:
            snapshots.append(int(torch.count_nonzero(args[-1])))
        return conv(*args)

    monkeypatch.setattr(kernels.chunking, "launch_plan", spy)
    monkeypatch.setattr(triton_conv, "causal_conv1d_varlen_triton", conv_spy)
    for module, name in TORCH_REFS:
        monkeypatch.setattr(module, name, _forbidden)
    with backend.use_backend("triton"):
        got = greedy(make_llm(tiny_model_dir, device, **cache), prompts, one_by_one=True)
    assert got == want
    assert sum(snapshots) > 0  # Triton wrote the checkpoints
