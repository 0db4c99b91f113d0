"""Bamba (``BambaForCausalLM``): Mamba2 layers with full attention at ``attn_layer_indices``.

Layer i is a pre-norm mixer (``mamba``: the Mamba2 mixer, gate before the norm; or
``self_attn``: Llama-style GQA with optional bias and *partial* RoPE on the first
``partial_rotary_factor`` (0.5, fixed by the config class) of each head) + residual, then
``pre_ff_layernorm`` and a SwiGLU ``feed_forward`` + residual; ``model.final_layernorm``.

Config fields read: ``attn_layer_indices`` (through ``layers_block_type``), the ``mamba_*``
dims (``mamba_expand`` checked against heads x head dim), ``mamba_conv_bias``,
``mamba_proj_bias``, ``time_step_limit``, ``hidden_act`` (the MLP's and the conv's
activation: only silu), ``attention_bias``, ``mlp_bias``, ``rope_parameters`` (default RoPE
only), ``rms_norm_eps``, ``tie_word_embeddings``. Not math: ``z_loss_coefficient`` (training),
dropout, init fields.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.models.base import FULL_ATTENTION, LINEAR_ATTENTION, HybridDecoderLayer, HybridForCausalLM, default_rope
from workers.models.layers import Attention, AttentionDims, DenseMLP, RMSNorm, RotaryEmbedding
from workers.models.mamba2 import Mamba2Mixer
from workers.models.mamba2_config import check_mamba_dims, head_dim, mamba_prefixed_dims
from workers.state_spec import StateSites


def attention_dims(cfg: Any) -> AttentionDims:
    hd = head_dim(cfg)
    return AttentionDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=hd,
        bias=bool(cfg.attention_bias),
        scale=hd**-0.5,
    )


class BambaForCausalLM(HybridForCausalLM):
    final_norm_name = "final_layernorm"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_mamba_dims(
            cfg, mamba_prefixed_dims(cfg), cfg.mamba_expand * cfg.hidden_size, "mamba_expand * hidden_size"
        )
        bad = [i for i in (cfg.attn_layer_indices or []) if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"attn_layer_indices {bad} are outside 0..{cfg.num_hidden_layers - 1}")
        if FULL_ATTENTION in cfg.layers_block_type:
            default_rope(cfg, head_dim(cfg))

    def _build_layers(
        self, cfg: Any, dtype: torch.dtype, sites: StateSites
    ) -> tuple[list[HybridDecoderLayer], RMSNorm]:
        layers = []
        for kind in cfg.layers_block_type:
            assert kind in (FULL_ATTENTION, LINEAR_ATTENTION), kind
            mixer: nn.Module
            if kind == FULL_ATTENTION:
                name, mixer = "self_attn", Attention(attention_dims(cfg), dtype)
            else:
                name, mixer = "mamba", Mamba2Mixer(mamba_prefixed_dims(cfg), dtype)
            ffn = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, act=cfg.hidden_act, bias=bool(cfg.mlp_bias))
            layers.append(
                HybridDecoderLayer(
                    name,
                    mixer,
                    sites.add(mixer),
                    {"feed_forward": ffn},
                    RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                    RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                    post_norm_name="pre_ff_layernorm",
                )
            )
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        if FULL_ATTENTION not in cfg.layers_block_type:
            return None
        return default_rope(cfg, head_dim(cfg))  # partial_rotary_factor from rope_parameters
