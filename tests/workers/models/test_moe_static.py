"""The MoE's traced formulation (``SparseMoE._routed_static``: gathered experts for few
rows, dense experts for many) against its expert loop, for each routing style."""

from __future__ import annotations

import pytest
import torch

from workers.models.moe import MoeDims, SparseMoE


def moe(style: str, gated: bool, seed: int) -> SparseMoE:
    dims = MoeDims(
        hidden_size=16,
        intermediate_size=8,
        num_experts=6,
        top_k=2,
        style=style,
        gated=gated,
        num_groups=2 if style == "sigmoid_grouped" else 1,
    )
    layer = SparseMoE(dims, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


@pytest.mark.parametrize("num_tokens", [1, 2, 9])  # 2 and 4 rows < 6 experts: gathered
@pytest.mark.parametrize("style,gated", [("qwen", True), ("granite", True), ("sigmoid_grouped", False)])
def test_static_routing_equals_the_loop(num_tokens, style, gated):
    layer = moe(style, gated, seed=num_tokens)
    x = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(7))
    weights, ids = layer._route(x)
    torch.testing.assert_close(
        layer._routed_static(x, weights, ids), layer._routed(x, weights, ids), atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("native", [False, True])
def test_compiled_cpu_step_takes_the_cheaper_formulation(monkeypatch, native):
    """Compiled on CPU: with the C++ loop (``kernels.native_ops`` loaded, fp32) the loop op at
    every size; with the Python op the static formulation for small batches and the loop beyond
    ``static_is_cheaper`` (6 experts, top-2: static up to T*E <= 64, i.e. 10 tokens); all
    equal the eager loop."""
    import workers.models.moe as moe_module
    from kernels import native_ops

    assert moe_module.static_is_cheaper(2, 6, 2) and moe_module.static_is_cheaper(10, 6, 2)
    assert not moe_module.static_is_cheaper(11, 6, 2)
    assert moe_module.static_is_cheaper(8, 8, 2) and not moe_module.static_is_cheaper(8, 8, 1)
    if native:
        assert native_ops.load(), native_ops.failure()
    monkeypatch.setitem(native_ops._state, "loaded", native)
    traced_ops: list[tuple[str, int]] = []
    pick = moe_module.expert_loop_op

    def counting_pick():
        op = pick()

        def counting_op(x, *args):
            traced_ops.append((str(op), x.shape[0]))
            return op(x, *args)

        return counting_op

    monkeypatch.setattr(moe_module, "expert_loop_op", counting_pick)
    layer = moe("qwen", True, seed=3)
    for num_tokens, takes_loop in ((3, native), (16, True)):
        traced_ops.clear()
        torch._dynamo.reset()
        x = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(num_tokens))
        weights, ids = layer._route(x)
        with torch.inference_mode():
            compiled = torch.compile(layer._routed, dynamic=False)(x, weights, ids)
        assert bool(traced_ops) == takes_loop, (num_tokens, traced_ops)
        assert all(("hybridserve_native" in name) == native for name, _ in traced_ops), traced_ops
        torch.testing.assert_close(compiled, layer._routed(x, weights, ids), atol=1e-6, rtol=1e-5)
    torch._dynamo.reset()
