"""Parts of the bench stage checked on the CPU: the HBM bound of an MoE step counts only the
experts some token picks, the experts column says what a captured step computes (no grouped
kernel), and the random MTP weights of the engine rows make a head."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import bench_decode as D


@pytest.fixture(scope="module")
def moe():
    return D.build(D.TOY_MOE, torch.device("cpu"), torch.float32).model


def test_the_bound_reads_the_expected_experts(moe):
    total = sum(p.numel() * p.element_size() for p in moe.parameters())
    layers = [m for m in moe.modules() if m.__class__.__name__ == "SparseMoE"]
    experts = sum(w.numel() * w.element_size() for m in layers for w in (m.w_gate, m.w_up, m.w_down))
    e, k = layers[0].dims.num_experts, layers[0].dims.top_k
    assert D.weight_bytes(moe, 1) == pytest.approx(total - experts * (1 - k / e))
    assert D.weight_bytes(moe, 1) < D.weight_bytes(moe, 4) < D.weight_bytes(moe, 64) <= total
    dense = D.build(D.TOY, torch.device("cpu"), torch.float32).model
    assert D.weight_bytes(dense, 1) == sum(p.numel() * p.element_size() for p in dense.parameters())


def test_the_experts_column_names_the_formulation(moe):
    assert D.experts_path(moe, 1).startswith("gathered rows (2 of 8")  # T*k < E
    assert "every expert on every token: 4x" in D.experts_path(moe, 4)  # E / k


@pytest.mark.parametrize("dims", ["TOY", "TOY_MOE"])
def test_random_mtp_weights_make_a_head(dims):
    """The engine rows' MTP mode builds its head from ``add_random_mtp``'s tensors (an MoE
    layer's experts included), for the model built in memory."""
    from tests.gpu.bench_engine import add_random_mtp

    model = D.build(getattr(D, dims), torch.device("cpu"), torch.float32).model
    add_random_mtp(model)
    head = model.build_mtp_head(kv_index=1)
    moe = any(n.startswith("mtp.layers.0.mlp.experts.") for n in model.mtp_weights)
    assert moe == (dims == "TOY_MOE") and head.num_layers == 1
    assert all(torch.isfinite(p).all() for p in head.parameters())
