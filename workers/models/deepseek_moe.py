"""DeepSeek-V3's feed-forward blocks as Kimi-Linear and BailingHybrid configure them.

``mlp_layer_types[i]`` is ``dense`` (a SwiGLU MLP of ``intermediate_size``) or ``sparse``:
sigmoid-routed experts with ``e_score_correction_bias``, grouped top-k (``n_group`` groups,
``topk_group`` kept), optional renormalisation (``norm_topk_prob``) and
``routed_scaling_factor`` (``SparseMoE`` style ``sigmoid_grouped``), plus shared experts: one
ungated-sum SwiGLU MLP of ``moe_intermediate_size * n_shared_experts``. Checkpoint names under
the block: ``gate.weight`` (fp32), ``gate.e_score_correction_bias``,
``experts.{e}.{gate,up,down}_proj.weight``, ``shared_experts.*`` (families rename their own
layouts onto these in ``checkpoint_name``).

``with_swiglu_limits`` clips a sparse block's SwiGLUs, routed and shared experts each by its
own limit (``moe_experts.swiglu``; BailingHybrid's per-layer lists); a dense layer's MLP is
never clipped, as in transformers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import nn

from workers.models.layers import DenseMLP
from workers.models.moe import MoeDims, SparseMoE
from workers.models.moe_experts import swiglu
from workers.models.weights import WeightTarget, module_targets

DENSE, SPARSE = "dense", "sparse"


class SwigluLimits(NamedTuple):
    """One layer's clipped-SwiGLU limits (0 = off)."""

    routed: float = 0.0
    shared: float = 0.0


class ClippedMLP(DenseMLP):
    """A SwiGLU MLP whose inner activation is clipped at ``limit`` (``moe_experts.swiglu``)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        *,
        act: str,
        limit: float,
        clip_input: bool = False,
    ) -> None:
        super().__init__(hidden_size, intermediate_size, dtype, act=act)
        self.limit, self.clip_input = limit, clip_input

    def _inner(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return swiglu(self.act, g, u, self.limit, self.clip_input)


class RoutedSharedMoE(nn.Module):
    """``routed(x) + shared_experts(x)``; under TP both shard by their intermediate dims."""

    def __init__(
        self, dims: MoeDims, shared_intermediate_size: int, dtype: torch.dtype, shared_limit: float = 0.0
    ) -> None:
        super().__init__()
        self.routed = SparseMoE(dims, dtype)
        self.shared_experts = (
            ClippedMLP(
                dims.hidden_size,
                shared_intermediate_size,
                dtype,
                act=dims.act,
                limit=shared_limit,
                clip_input=dims.swiglu_clip_input,
            )
            if shared_limit > 0
            else DenseMLP(dims.hidden_size, shared_intermediate_size, dtype, act=dims.act)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed(x) + self.shared_experts(x)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = self.routed.weight_targets(prefix)
        targets.update(module_targets(self.shared_experts, f"{prefix}shared_experts."))
        return targets


def check_mlp_layer_types(cfg: Any) -> list[str]:
    kinds = list(cfg.mlp_layer_types)
    if len(kinds) != cfg.num_hidden_layers:
        raise ValueError(f"mlp_layer_types has {len(kinds)} entries, num_hidden_layers={cfg.num_hidden_layers}")
    unknown = sorted(set(kinds) - {DENSE, SPARSE})
    if unknown:
        raise ValueError(f"mlp_layer_types has unsupported entries {unknown}; expected {DENSE!r} or {SPARSE!r}")
    return kinds


def moe_dims(cfg: Any) -> MoeDims:
    return MoeDims(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok,
        style="sigmoid_grouped",
        norm_topk_prob=bool(cfg.norm_topk_prob),
        act=cfg.hidden_act,
        num_groups=cfg.n_group,
        topk_groups=cfg.topk_group,
        routed_scaling_factor=float(cfg.routed_scaling_factor),
    )


def build_ffn(cfg: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    if cfg.mlp_layer_types[layer_idx] == DENSE:
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, act=cfg.hidden_act)
    if cfg.n_shared_experts < 1:
        raise ValueError(
            f"n_shared_experts={cfg.n_shared_experts}: transformers always builds "
            "the shared experts (moe_intermediate_size * n_shared_experts)"
        )
    return RoutedSharedMoE(moe_dims(cfg), cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)


def with_swiglu_limits(ffn: nn.Module, limits: SwigluLimits) -> nn.Module:
    """``ffn`` (``build_ffn``'s, weights not loaded yet) with its SwiGLUs clipped at ``limits``:
    a ``RoutedSharedMoE`` rebuilt with them, a dense MLP (or no limit) returned as is."""
    if not isinstance(ffn, RoutedSharedMoE) or limits == SwigluLimits():
        return ffn
    dims = replace(ffn.routed.dims, swiglu_limit=limits.routed)
    return RoutedSharedMoE(
        dims, ffn.shared_experts.intermediate_size, ffn.routed.w_up.dtype, shared_limit=limits.shared
    )
