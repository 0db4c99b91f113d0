"""The MoE's traced formulation (``SparseMoE._routed_static``: gathered experts for few
rows, dense experts for many) against its expert loop, for each routing style."""
from __future__ import annotations

import pytest
import torch

from workers.models.moe import MoeDims, SparseMoE


def moe(style: str, gated: bool, seed: int) -> SparseMoE:
    dims = MoeDims(hidden_size=16, intermediate_size=8, num_experts=6, top_k=2, style=style,
                   gated=gated, num_groups=2 if style == "sigmoid_grouped" else 1)
    layer = SparseMoE(dims, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


@pytest.mark.parametrize("num_tokens", [1, 2, 9])        # 2 and 4 rows < 6 experts: gathered
@pytest.mark.parametrize("style,gated", [("qwen", True), ("granite", True), ("sigmoid_grouped", False)])
def test_static_routing_equals_the_loop(num_tokens, style, gated):
    layer = moe(style, gated, seed=num_tokens)
    x = torch.randn(num_tokens, 16, generator=torch.Generator().manual_seed(7))
    weights, ids = layer._route(x)
    torch.testing.assert_close(layer._routed_static(x, weights, ids), layer._routed(x, weights, ids),
                               atol=1e-6, rtol=1e-5)
