"""Granite-4.0-H (``GraniteMoeHybridForCausalLM``): Mamba2 / attention, shared MLP + MoE.

Layer i is ``linear_attention`` (Mamba2 mixer, ``mamba``) or ``full_attention``
(``self_attn``, plain GQA, softmax scale = ``attention_multiplier``, RoPE only when
``position_embedding_type == "rope"``, else NoPE). The feed-forward is
``block_sparse_moe(x) + shared_mlp(x)`` (just ``shared_mlp`` without experts). Both residual
branches are scaled by ``residual_multiplier``; embeddings by ``embedding_multiplier``;
logits divided by ``logits_scaling``. RMSNorms are plain (weight, not 1 + weight).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.models.base import (
    FULL_ATTENTION,
    HybridDecoderLayer,
    HybridForCausalLM,
    check_hybrid_layer_types,
    default_rope,
)
from workers.models.layers import Attention, AttentionDims, DenseMLP, RMSNorm, RotaryEmbedding
from workers.models.mamba2 import Mamba2Dims, Mamba2Mixer
from workers.models.mamba2_config import check_mamba_dims, head_dim, mamba_prefixed_dims
from workers.models.moe import MoeDims, SparseMoE
from workers.state_spec import StateSites

_POSITION_TYPES = (None, "nope", "rope")


def mamba_dims(cfg: Any) -> Mamba2Dims:
    return mamba_prefixed_dims(cfg, norm_before_gate=False)


def attention_dims(cfg: Any) -> AttentionDims:
    return AttentionDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim(cfg),
        bias=bool(cfg.attention_bias),
        scale=float(cfg.attention_multiplier),
    )


def build_ffns(cfg: Any, dtype: torch.dtype) -> dict[str, nn.Module]:
    shared = DenseMLP(
        cfg.hidden_size, cfg.shared_intermediate_size, dtype, fused_names=("input_linear", "output_linear")
    )
    if not cfg.num_local_experts:
        return {"shared_mlp": shared}
    dims = MoeDims(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_experts=cfg.num_local_experts,
        top_k=cfg.num_experts_per_tok,
        style="granite",
    )
    return {"block_sparse_moe": SparseMoE(dims, dtype), "shared_mlp": shared}


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hf_config, dtype, device)
        self.embedding_multiplier = float(hf_config.embedding_multiplier)
        self.logits_scaling = float(hf_config.logits_scaling)

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_hybrid_layer_types(cfg)
        if cfg.position_embedding_type not in _POSITION_TYPES:
            raise ValueError(
                f"position_embedding_type={cfg.position_embedding_type!r} is not "
                f"supported; expected one of {_POSITION_TYPES}"
            )
        check_mamba_dims(
            cfg, mamba_dims(cfg), cfg.mamba_expand * cfg.hidden_size, "mamba_expand * hidden_size", act_field=None
        )
        if not cfg.logits_scaling:
            raise ValueError("logits_scaling must be non-zero")
        if cfg.position_embedding_type == "rope":
            default_rope(cfg, head_dim(cfg), partial_factor=1.0)

    def _build_layers(
        self, cfg: Any, dtype: torch.dtype, sites: StateSites
    ) -> tuple[list[HybridDecoderLayer], RMSNorm]:
        layers = []
        for kind in cfg.layer_types:
            if kind == FULL_ATTENTION:
                name, mixer = "self_attn", Attention(attention_dims(cfg), dtype)
            else:
                name, mixer = "mamba", Mamba2Mixer(mamba_dims(cfg), dtype)
            layers.append(
                HybridDecoderLayer(
                    name,
                    mixer,
                    sites.add(mixer),
                    build_ffns(cfg, dtype),
                    RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                    RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                    residual_multiplier=float(cfg.residual_multiplier),
                )
            )
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        if cfg.position_embedding_type != "rope":
            return None
        return default_rope(cfg, head_dim(cfg), partial_factor=1.0)
