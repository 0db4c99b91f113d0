"""The state description (``workers/state_spec.py``) and what reads it: pools and sizing.

Exact checks on hand-built specs (including kinds no model has yet, to show that a new kind
of state needs no edit in the pools), then the specs the registered families derive.
"""

from __future__ import annotations

import pytest
import torch

from configs.schema import load_config
from workers.device_pools import build_pools
from workers.loader import load_model
from workers.sizing import plan_pools
from workers.state_spec import (
    ATTENTION,
    CacheSpec,
    StateGroup,
    StateKind,
    StateRef,
    StateSites,
    TensorSpec,
    attention_kind,
    conv_ssm_kind,
)

# Kinds of a later issue, described without any model: short conv only, and a lightning
# attention state [H, D, D] without conv.
SHORT_CONV = StateKind("short_conv", False, (TensorSpec("conv", (12, 2)),))
LIGHTNING = StateKind("lightning", False, (TensorSpec("ssm", (2, 4, 4), "float32"),))


class Site:
    def __init__(self, kind: StateKind) -> None:
        self.kind = kind

    def state_kind(self) -> StateKind:
        return self.kind


def test_sites_group_by_kind_and_count_layers() -> None:
    sites = StateSites()
    attn = Site(attention_kind(2, 8, v_head_dim=4))
    refs = [sites.add(m) for m in (Site(SHORT_CONV), attn, Site(SHORT_CONV), attn, Site(LIGHTNING))]
    assert refs == [
        StateRef("short_conv", 0),
        StateRef(ATTENTION, 0),
        StateRef("short_conv", 1),
        StateRef(ATTENTION, 1),
        StateRef("lightning", 0),
    ]
    spec = sites.spec()
    assert [(g.kind.name, g.num_layers) for g in spec.groups] == [("short_conv", 2), (ATTENTION, 2), ("lightning", 1)]
    assert [g.kind.name for g in spec.paged_groups] == [ATTENTION]
    assert spec.num_layers("missing") == 0
    # per token: 2 layers x (k 2x8 + v 2x4) x 4 bytes; per slot: 2 x 12x2 x 2 (bf16) + 32 x 4
    assert spec.bytes_per_token(torch.float32) == 2 * (16 + 8) * 4
    assert spec.bytes_per_slot(torch.bfloat16) == 2 * 24 * 2 + 32 * 4


def test_a_kind_must_keep_one_shape_and_dense_indices() -> None:
    with pytest.raises(ValueError, match="disagree on its shapes"):
        CacheSpec.from_sites(
            [
                (StateRef("mamba2", 0), conv_ssm_kind("mamba2", 8, 4, (2, 4, 4))),
                (StateRef("mamba2", 1), conv_ssm_kind("mamba2", 16, 4, (4, 4, 4))),
            ]
        )
    with pytest.raises(ValueError, match=r"indices \[0, 2\]"):
        CacheSpec.from_sites(
            [
                (StateRef("gdn", 0), conv_ssm_kind("gdn", 8, 4, (2, 4, 4))),
                (StateRef("gdn", 2), conv_ssm_kind("gdn", 8, 4, (2, 4, 4))),
            ]
        )
    spec = CacheSpec((StateGroup(attention_kind(2, 8), 3),))
    assert spec.with_layers(ATTENTION, 4).num_layers(ATTENTION) == 4
    assert CacheSpec().with_layers(ATTENTION, 0) == CacheSpec()
    with pytest.raises(ValueError, match="keeps no 'attention' state"):
        CacheSpec().with_layers(ATTENTION, 1)


def test_pools_hold_every_kind_and_copy_every_tensor() -> None:
    spec = CacheSpec((StateGroup(SHORT_CONV, 2), StateGroup(attention_kind(2, 8, 4), 1), StateGroup(LIGHTNING, 3)))
    pools = build_pools(spec, num_pages=3, page_size=4, num_slots=5, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert pools.kv.k.shape == (1, 12, 2, 8) and pools.kv.v.shape == (1, 12, 2, 4)
    conv = pools.mamba.groups["short_conv"]["conv"]
    ssm = pools.mamba.groups["lightning"]["ssm"]
    assert conv.shape == (2, 5, 12, 2) and conv.dtype == torch.bfloat16
    assert ssm.shape == (3, 5, 2, 4, 4) and ssm.dtype == torch.float32
    assert pools.mamba.layer(StateRef("lightning", 2))["ssm"].data_ptr() == ssm[2].data_ptr()
    for t in pools.mamba.tensors():
        t[:, 1] = 7.0
    pools.mamba.copy_slot(torch.tensor([1]), torch.tensor([3]))
    assert all(bool((t[:, 3] == 7.0).all()) and bool((t[:, 2] == 0).all()) for t in pools.mamba.tensors())
    pools.mamba.zero_slot(torch.tensor([1, 3]))
    assert all(not t.any() for t in pools.mamba.tensors())
    assert pools.mamba.bytes_per_entry() == spec.bytes_per_slot(torch.bfloat16)
    assert pools.kv.bytes_per_entry() == spec.bytes_per_token(torch.bfloat16)


def test_copy_slots_from_host_lists_equals_copy_slot() -> None:
    """The in-place pair copies give copy_slot's result, overlapping pairs included (read
    before any write: a slot that is both a source and a destination takes the old state)."""
    spec = CacheSpec((StateGroup(SHORT_CONV, 2), StateGroup(LIGHTNING, 3)))
    cases = [([1], [3]), ([1, 2], [3, 4]), ([1, 3], [3, 4]), ([2, 2], [1, 4])]
    for src, dst in cases:
        pools = [
            build_pools(
                spec, num_pages=3, page_size=4, num_slots=5, dtype=torch.float32, device=torch.device("cpu")
            ).mamba
            for _ in range(2)
        ]
        for pool in pools:
            for t in pool.tensors():
                t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape))
        pools[0].copy_slot(torch.tensor(src), torch.tensor(dst))
        pools[1].copy_slots(src, dst)
        assert all(torch.equal(a, b) for a, b in zip(pools[0].tensors(), pools[1].tensors())), (src, dst)
    with pytest.raises(ValueError, match="2 sources for 1 destinations"):
        pools[1].copy_slots([1, 2], [3])


def test_no_paged_state_means_page_bookkeeping_only() -> None:
    spec = CacheSpec((StateGroup(conv_ssm_kind("mamba2", 8, 4, (2, 4, 4)), 2),))
    config = load_config(overrides={"cache": {"page_size": 16}})
    sizes = plan_pools(config, spec, model_max_len=1 << 20)
    assert sizes.num_pages == 8 * 32768 // 16 + 1 and sizes.kv_bytes == 0
    assert sizes.max_model_len == 8 * 32768
    assert sizes.bytes_per_slot == 2 * (8 * 3 * 4 + 32 * 4)
    assert sizes.slot_bytes == sizes.num_slots * sizes.bytes_per_slot
    pools = build_pools(spec, sizes.num_pages, 16, 4, torch.float32, torch.device("cpu"))
    assert pools.kv.groups == {} and pools.kv.num_pages == sizes.num_pages
    bounded = plan_pools(
        load_config(overrides={"cache": {"page_size": 16, "max_kv_tokens": 640}}), spec, model_max_len=1 << 20
    )
    assert bounded.num_pages == 41 and bounded.max_model_len == 640
    with_kv = CacheSpec(spec.groups + (StateGroup(attention_kind(2, 8), 1),))
    assert plan_pools(config, with_kv, 1 << 20).num_pages == 32768 // 16 + 1


def test_max_model_len_is_the_configs_when_the_model_and_the_pool_allow_it() -> None:
    spec = CacheSpec((StateGroup(attention_kind(2, 8), 1),))
    config = load_config(overrides={"max_model_len": 512, "cache.max_kv_tokens": 640})
    assert plan_pools(config, spec, model_max_len=1024).max_model_len == 512
    with pytest.raises(ValueError, match=r"max_model_len=512 exceeds .*model \(256 positions\)"):
        plan_pools(config, spec, model_max_len=256)
    with pytest.raises(ValueError, match=r"max_model_len=1024 exceeds .*KV pool \(640 tokens"):
        plan_pools(load_config(overrides={"max_model_len": 1024, "cache.max_kv_tokens": 640}), spec, 1 << 20)


def test_family_specs(tiny_checkpoint) -> None:
    """What each family's layers declare: no KV for Mamba2, both kinds in every Falcon-H1
    layer, one KV per invocation of Zamba2's shared blocks, Nemotron-H's MLP/MoE keep none,
    Mamba1's [d_inner, N] scan state, a short conv's window and nothing else."""

    def layers(name: str) -> dict[str, int]:
        spec = load_model(tiny_checkpoint(name), torch.float32, "meta").model.cache_spec()
        return {g.kind.name: g.num_layers for g in spec.groups}

    assert layers("mamba2") == {"mamba2": 4}
    assert layers("falcon_h1") == {"mamba2": 4, ATTENTION: 4}
    assert layers("zamba2") == {"mamba2": 6, ATTENTION: 3}
    assert layers("nemotron_h") == {"mamba2": 2, ATTENTION: 2}
    assert layers("qwen3_next") == {"gdn": 3, ATTENTION: 2}
    assert layers("jamba") == {"mamba1": 3, ATTENTION: 2}
    assert layers("lfm2") == {"short_conv": 3, ATTENTION: 2}
    assert layers("lfm3") == {"short_conv": 3, ATTENTION: 3}  # sliding layers keep full KV
    jamba = load_model(tiny_checkpoint("jamba"), torch.float32, "meta").model.cache_spec()
    assert [(t.name, t.shape, t.dtype) for t in jamba.group("mamba1").kind.tensors] == [
        ("conv", (128, 3), None),
        ("ssm", (128, 16), "float32"),
    ]
    lfm2 = load_model(tiny_checkpoint("lfm2"), torch.float32, "meta").model.cache_spec()
    assert [(t.name, t.shape) for t in lfm2.group("short_conv").kind.tensors] == [("conv", (64, 2))]
    assert layers("kimi_linear") == layers("bailing_hybrid") == {"kda": 3, "mla": 2}
    assert layers("minimax") == {"lightning": 3, ATTENTION: 2}
    assert layers("olmo_hybrid") == {"gdn": 3, ATTENTION: 2}


def test_new_kinds_shapes_and_the_honest_mla_pool(tiny_checkpoint) -> None:
    """MLA keeps one row [latent | rope key] per token and layer, not per-head K and V; KDA a
    q, k, v conv window and a [H, D, D] state; lightning attention a state and no conv."""

    def spec(name: str) -> CacheSpec:
        return load_model(tiny_checkpoint(name), torch.float32, "meta").model.cache_spec()

    kimi = spec("kimi_linear")  # kv_lora_rank 32, qk_rope_head_dim 8, 4 heads of 16
    mla, kda = kimi.group("mla"), kimi.group("kda")
    assert mla is not None and kda is not None and mla.kind.paged and not kda.kind.paged
    assert [(t.name, t.shape) for t in mla.kind.tensors] == [("latent", (1, 40))]
    assert kimi.bytes_per_token(torch.bfloat16) == 2 * 40 * 2
    assert [(t.name, t.shape, t.dtype) for t in kda.kind.tensors] == [
        ("conv", (3 * 4 * 16, 3), None),
        ("ssm", (4, 16, 16), "float32"),
    ]
    lightning = spec("minimax").group("lightning")
    assert lightning is not None
    assert [(t.name, t.shape) for t in lightning.kind.tensors] == [("ssm", (4, 16, 16))]
