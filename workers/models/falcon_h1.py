"""Falcon-H1 (``FalconH1ForCausalLM``): attention and Mamba2 side by side in every layer.

Layer i: ``x = input_layernorm(h)``; ``h += mamba(x) * ssm_out_multiplier +
self_attn(x * attention_in_multiplier) * attention_out_multiplier``; then
``h += feed_forward(pre_ff_layernorm(h))``, a SwiGLU with ``mlp_multipliers`` (gate, down).
Every layer keeps both a KV (attention kind) and a Mamba2 state. The mixer's inner width is
``mamba_d_ssm`` (or ``mamba_expand * hidden_size``), its input is scaled by
``ssm_in_multiplier``, in_proj's five segments (z, x, B, C, dt) by ``ssm_multipliers``; its
norm is optional (``mamba_rms_norm``; without it ``y * silu(z)``) and gates before or after
(``mamba_norm_before_gate``); out_proj's bias is ``projectors_bias``. Keys are scaled by
``key_multiplier``, embeddings by ``embedding_multiplier``, logits by ``lm_head_multiplier``.
RoPE covers the whole head (transformers' Falcon-H1 ignores ``partial_rotary_factor``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.models.base import HybridForCausalLM, default_rope
from workers.models.layers import Attention, AttentionDims, DenseMLP, LayerContext, RMSNorm, RotaryEmbedding
from workers.models.mamba2 import Mamba2Dims, Mamba2Mixer
from workers.models.mamba2_config import check_mamba_dims, head_dim, mamba_prefixed_dims
from workers.state_spec import StateRef, StateSites


def d_ssm(cfg: Any) -> int:
    return cfg.mamba_d_ssm if cfg.mamba_d_ssm is not None else int(cfg.mamba_expand * cfg.hidden_size)


def mamba_dims(cfg: Any) -> Mamba2Dims:
    return mamba_prefixed_dims(
        cfg,
        norm_before_gate=bool(cfg.mamba_norm_before_gate),
        rms_norm=bool(cfg.mamba_rms_norm),
        out_proj_bias=bool(cfg.projectors_bias),
        input_multiplier=float(cfg.ssm_in_multiplier),
        proj_multipliers=tuple(float(m) for m in cfg.ssm_multipliers),
    )


def attention_dims(cfg: Any) -> AttentionDims:
    hd = head_dim(cfg)
    return AttentionDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=hd,
        bias=bool(cfg.attention_bias),
        scale=hd**-0.5,
        key_multiplier=float(cfg.key_multiplier),
    )


class FalconH1DecoderLayer(nn.Module):
    """Parallel Mamba2 + attention on one normed input, then the MLP (see the module docstring)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mamba = Mamba2Mixer(mamba_dims(cfg), dtype)
        self.self_attn = Attention(attention_dims(cfg), dtype)
        self.mamba_ref: StateRef = sites.add(self.mamba)
        self.attn_ref: StateRef = sites.add(self.self_attn)
        gate_mult, down_mult = (float(m) for m in cfg.mlp_multipliers)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.feed_forward = DenseMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            dtype,
            act=cfg.hidden_act,
            bias=bool(cfg.mlp_bias),
            gate_multiplier=gate_mult,
            down_multiplier=down_mult,
        )
        self.ssm_out_multiplier = float(cfg.ssm_out_multiplier)
        self.attention_in_multiplier = float(cfg.attention_in_multiplier)
        self.attention_out_multiplier = float(cfg.attention_out_multiplier)

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        m = self.mamba(x, ctx, self.mamba_ref) * self.ssm_out_multiplier
        a = self.self_attn(x * self.attention_in_multiplier, ctx, self.attn_ref)
        hidden = hidden + (m + a * self.attention_out_multiplier)
        return hidden + self.feed_forward(self.pre_ff_layernorm(hidden))


class FalconH1ForCausalLM(HybridForCausalLM):
    final_norm_name = "final_layernorm"

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hf_config, dtype, device)
        self.embedding_multiplier = float(hf_config.embedding_multiplier)
        self.logits_multiplier = float(hf_config.lm_head_multiplier)

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_mamba_dims(cfg, mamba_dims(cfg), d_ssm(cfg), "mamba_d_ssm (or mamba_expand * hidden_size)")
        if len(cfg.mlp_multipliers) != 2:
            raise ValueError(f"mlp_multipliers must have 2 entries (gate, down), got {cfg.mlp_multipliers}")
        default_rope(cfg, head_dim(cfg), partial_factor=1.0)

    def _build_layers(
        self, cfg: Any, dtype: torch.dtype, sites: StateSites
    ) -> tuple[list[FalconH1DecoderLayer], RMSNorm]:
        layers = [FalconH1DecoderLayer(cfg, dtype, sites) for _ in range(cfg.num_hidden_layers)]
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return default_rope(cfg, head_dim(cfg), partial_factor=1.0)
