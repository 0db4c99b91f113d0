"""RecurrentGemma (``RecurrentGemmaForCausalLM``, Griffin): RG-LRU recurrent blocks and local
attention, in the repeating pattern ``block_types`` (recurrentgemma-2b: recurrent, recurrent,
attention).

Layer i: ``temporal_pre_norm`` -> ``temporal_block`` -> residual; ``channel_pre_norm`` ->
``mlp_block`` -> residual. Every RMSNorm is Gemma's ``(1 + weight)`` in fp32. The temporal
block is Griffin's recurrent block (``workers/models/rglru.py``: RG-LRU state
[lru_width] fp32 and a conv window) or local attention: GQA over the last
``attention_window_size`` positions (the paged KV keeps every token, the pages before the
window are not read, as Lfm3's sliding layers), RoPE on ``partial_rotary_factor`` of the
head (0.5), q/k/v biases from ``attention_bias``, ``o_proj`` always with a bias. The MLP is
``down(act(gate(x)) * up(x))`` of ``intermediate_size // 2`` with biases. The embeddings are
scaled by sqrt(hidden_size) rounded to bfloat16 (transformers keeps that normaliser as a
bf16 buffer), and the logits soft-capped: ``tanh(logits / logits_soft_cap) * cap``.

Config fields read: ``block_types``, ``lru_width``, ``conv1d_width``,
``attention_window_size``, ``num_attention_heads``, ``num_key_value_heads``,
``attention_bias``, ``rope_parameters`` (``rope_theta``, ``partial_rotary_factor``),
``hidden_activation``, ``intermediate_size``, ``rms_norm_eps``, ``logits_soft_cap``,
``tie_word_embeddings``. Refused: ``rope_type`` other than default, unknown block types,
``lru_width`` not a multiple of the heads, a non-positive window or soft cap. Not math:
``w_init_variance_scale``, ``final_w_init_variance_scale``, ``attention_dropout``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.models.base import HybridForCausalLM, default_rope
from workers.models.layers import Attention, AttentionDims, DenseMLP, LayerContext, RMSNorm, RotaryEmbedding, linear
from workers.models.rglru import RecurrentBlock, RglruDims
from workers.state_spec import StateRef, StateSites

BLOCK_TYPES = ("recurrent", "attention")
FINAL_NORM = "model.final_norm."


def layer_kinds(cfg: Any) -> list[str]:
    kinds = list(cfg.block_types)
    unknown = sorted(set(kinds) - set(BLOCK_TYPES))
    if not kinds or unknown:
        raise ValueError(f"block_types={kinds!r}: every entry must be one of {BLOCK_TYPES}")
    return (kinds * (cfg.num_hidden_layers // len(kinds) + 1))[: cfg.num_hidden_layers]


def head_dim(cfg: Any) -> int:
    return cfg.hidden_size // cfg.num_attention_heads


class LocalAttention(Attention):
    """transformers' RecurrentGemma attention: ``o_proj`` has a bias whatever ``attention_bias`` says."""

    def __init__(self, dims: AttentionDims, dtype: torch.dtype) -> None:
        super().__init__(dims, dtype)
        self.o_proj = linear(dims.num_heads * dims.head_dim, dims.hidden_size, True, dtype)


class ResidualBlock(nn.Module):
    """Griffin's residual block (checkpoint names ``temporal_pre_norm``, ``temporal_block``,
    ``channel_pre_norm``, ``mlp_block``)."""

    def __init__(self, temporal_block: nn.Module, ref: StateRef, mlp: DenseMLP, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.temporal_pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, zero_centered=True)
        self.temporal_block = temporal_block
        self.channel_pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, zero_centered=True)
        self.mlp_block = mlp
        self.ref = ref

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        hidden = hidden + self.temporal_block(self.temporal_pre_norm(hidden), ctx, self.ref)
        return hidden + self.mlp_block(self.channel_pre_norm(hidden))


class RecurrentGemmaForCausalLM(HybridForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hf_config, dtype, device)
        # transformers' normaliser is a bf16 buffer: sqrt(hidden_size) rounded to bf16
        self.embedding_multiplier = torch.tensor(self.config.hidden_size**0.5, dtype=torch.bfloat16).item()
        self.soft_cap = float(self.config.logits_soft_cap)

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        layer_kinds(cfg)
        cls.rglru_dims(cfg).validate()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={cfg.num_key_value_heads}"
            )
        if cfg.attention_window_size is None or cfg.attention_window_size < 1:
            raise ValueError(f"attention_window_size={cfg.attention_window_size!r} must be positive")
        if cfg.logits_soft_cap is None or cfg.logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap={cfg.logits_soft_cap!r} must be positive")
        default_rope(cfg, head_dim(cfg))

    @staticmethod
    def rglru_dims(cfg: Any) -> RglruDims:
        return RglruDims(
            cfg.hidden_size, cfg.lru_width, cfg.num_attention_heads, cfg.conv1d_width, cfg.hidden_activation
        )

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[ResidualBlock], RMSNorm]:
        hd = head_dim(cfg)
        dims = AttentionDims(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=hd,
            bias=bool(cfg.attention_bias),
            scale=hd**-0.5,
            sliding_window=cfg.attention_window_size,
        )
        layers = []
        for kind in layer_kinds(cfg):
            block: nn.Module
            if kind == "recurrent":
                block = RecurrentBlock(self.rglru_dims(cfg), dtype)
            else:
                block = LocalAttention(dims, dtype)
            mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size // 2, dtype, act=cfg.hidden_activation, bias=True)
            layers.append(ResidualBlock(block, sites.add(block), mlp, cfg, dtype))
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, zero_centered=True)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return default_rope(cfg, head_dim(cfg))

    def checkpoint_name(self, name: str) -> str:
        # ``model.final_norm`` is held as ``model.norm`` (``Backbone.final_norm`` is a property)
        return "model.norm." + name[len(FINAL_NORM) :] if name.startswith(FINAL_NORM) else name

    def logits_from(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = super().logits_from(hidden, weight)
        return torch.tanh(logits / self.soft_cap) * self.soft_cap
