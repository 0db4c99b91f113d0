"""BailingHybrid's clipped SwiGLU against the torch formula on a tiny checkpoint.

transformers 5.25 clips a sparse layer's SwiGLUs at the per-layer ``expert_swiglu_limit_list``
(routed experts) and ``share_expert_swiglu_limit_list`` (shared experts), 0 = off:
``min(silu(gate), L) * clamp(up, -L, L)``; dense layers are never clipped. The pinned 5.24
ignores both lists, so it cannot be the oracle: the formula is, written out per token below.
Every expert path is checked: the eager loop (native on CPU, few and many rows an expert), the
Python reference loop and the static formulation of compiled and GPU steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.models.deepseek_moe import RoutedSharedMoE
from workers.models.moe_experts import reference_loop

# the tiny config's mlp_layer_types: dense, sparse, sparse, dense, sparse
ROUTED = [0.3, 0.0, 0.25, 0.2, 0.15]  # dense layers' entries are ignored
SHARED = [0.4, 0.35, 0.0, 0.5, 0.3]
TOL = 1e-5


def swiglu_formula(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if limit == 0:
        return F.silu(gate) * up
    return torch.minimum(F.silu(gate), torch.tensor(limit)) * torch.clamp(up, -limit, limit)


def block_formula(moe: RoutedSharedMoE, x: torch.Tensor, routed: float, shared: float) -> torch.Tensor:
    """routed + shared experts token by token (the routing itself is compared with
    transformers elsewhere; its weights and ids are taken from the module)."""
    r = moe.routed
    weights, ids = r._route(x)
    se = moe.shared_experts
    assert se.gate_proj is not None
    out = swiglu_formula(x @ se.gate_proj.weight.T, x @ se.up_proj.weight.T, shared) @ se.down_proj.weight.T
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            assert r.w_gate is not None
            inner = swiglu_formula(r.w_gate[e] @ x[t], r.w_up[e] @ x[t], routed)
            out[t] += w * (r.w_down[e] @ inner)
    return out


@pytest.fixture(scope="module")
def clipped_model(tmp_path_factory):
    from tools.tiny import make_tiny_checkpoint
    from workers.loader import load_model

    ckpt = make_tiny_checkpoint(
        "bailing_hybrid",
        tmp_path_factory.mktemp("clipped"),
        seed=2,
        expert_swiglu_limit_list=ROUTED,
        share_expert_swiglu_limit_list=SHARED,
    )
    return load_model(ckpt, torch.float32, "cpu").model


@pytest.mark.parametrize("num_tokens", [3, 96])  # few / many rows an expert (native loop)
def test_sparse_layers_clip_as_the_formula(clipped_model, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    sparse = [i for i, kind in enumerate(clipped_model.config.mlp_layer_types) if kind == "sparse"]
    for i in sparse:
        moe = clipped_model.model.layers[i].mlp
        x = torch.randn(num_tokens, clipped_model.config.hidden_size, generator=gen)
        want = block_formula(moe, x, ROUTED[i], SHARED[i])
        if ROUTED[i] or SHARED[i]:  # the clip binds: unclipped differs
            assert (want - block_formula(moe, x, 0.0, 0.0)).abs().max() > 1e-3
        r, shared = moe.routed, moe.shared_experts(x)
        weights, ids = r._route(x)
        loops = reference_loop(x, weights, ids, r.w_gate, r.w_up, r.w_down, "silu", r.dims.swiglu_limit)
        for path, got in (
            ("eager", moe(x)),
            ("static", r._routed_static(x, weights, ids) + shared),
            ("reference", loops + shared),
        ):
            assert (got - want).abs().max() <= TOL, f"layer {i}, {path}"


def test_dense_layers_are_not_clipped(clipped_model) -> None:
    gen = torch.Generator().manual_seed(0)
    for i, kind in enumerate(clipped_model.config.mlp_layer_types):
        if kind != "dense":
            continue
        mlp = clipped_model.model.layers[i].mlp
        x = torch.randn(5, clipped_model.config.hidden_size, generator=gen)
        want = swiglu_formula(x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T, 0.0)
        want = want @ mlp.down_proj.weight.T
        assert (mlp(x) - want).abs().max() <= TOL, f"layer {i}"
