"""Jamba (``JambaForCausalLM``): Mamba1 layers with attention every ``attn_layer_period``
layers, and MoE every ``expert_layer_period`` layers.

Layer i is ``self_attn`` (GQA without positional encoding, no bias, scale head_dim^-1/2)
when ``i % attn_layer_period == attn_layer_offset``, else ``mamba`` (the Mamba1 mixer with
the dt / B / C RMSNorms, ``workers/models/mamba1.py``); then ``pre_ff_layernorm`` and the
``feed_forward``: a softmax top-k MoE (weights not renormalised; checkpoint
``router.weight``, ``experts.{e}.{gate,up,down}_proj`` or fused ``experts.gate_up_proj`` /
``experts.down_proj``) when
``i % expert_layer_period == expert_layer_offset`` and ``num_experts > 1``, else a SwiGLU MLP.
``model.final_layernorm``; ``lm_head`` tied only if ``tie_word_embeddings``.

Config fields read: the layer periods / offsets, ``num_experts``, ``num_experts_per_tok``,
``mamba_d_state``, ``mamba_d_conv``, ``mamba_expand``, ``mamba_dt_rank``,
``mamba_conv_bias``, ``mamba_proj_bias``, ``hidden_act`` (the MLP's and the conv's: only
silu), ``rms_norm_eps`` (every norm, the mixer's three included), ``head_dim`` when given,
``tie_word_embeddings``. Refused: ``sliding_window`` set (older Jamba configs carry it;
transformers 5.24 ignores it, so only None is served). Not math: ``use_mamba_kernels``,
``use_mambapy``, ``use_associative_scan`` (kernel choices), router loss and dropout fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from workers.models.base import HybridDecoderLayer, HybridForCausalLM
from workers.models.layers import Attention, AttentionDims, DenseMLP, RMSNorm, RotaryEmbedding
from workers.models.mamba1 import Mamba1Dims, Mamba1Mixer
from workers.models.mamba2_config import head_dim
from workers.models.moe import MoeDims, SparseMoE, unfuse_expert_tensors
from workers.state_spec import StateSites

ATTENTION_KIND, MAMBA_KIND = "attention", "mamba"


def mamba_dims(cfg: Any) -> Mamba1Dims:
    return Mamba1Dims(
        hidden_size=cfg.hidden_size,
        d_inner=cfg.mamba_expand * cfg.hidden_size,
        state_size=cfg.mamba_d_state,
        dt_rank=int(cfg.mamba_dt_rank),
        conv_kernel=cfg.mamba_d_conv,
        conv_bias=bool(cfg.mamba_conv_bias),
        proj_bias=bool(cfg.mamba_proj_bias),
        inner_norm_eps=cfg.rms_norm_eps,
    )


def attention_dims(cfg: Any) -> AttentionDims:
    hd = head_dim(cfg)
    return AttentionDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=hd,
        bias=False,
        scale=hd**-0.5,
    )


def build_ffn(cfg: Any, num_experts: int, dtype: torch.dtype) -> nn.Module:
    if num_experts <= 1:
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)
    return SparseMoE(
        MoeDims(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_experts=num_experts,
            top_k=cfg.num_experts_per_tok,
            style="qwen",
            norm_topk_prob=False,
        ),
        dtype,
    )


class JambaForCausalLM(HybridForCausalLM):
    final_norm_name = "final_layernorm"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(
                f"hidden_act={cfg.hidden_act!r} is not supported (it is also the Mamba conv activation; only 'silu')"
            )
        if getattr(cfg, "sliding_window", None) is not None:
            raise ValueError(
                f"sliding_window={cfg.sliding_window!r} is not supported "
                "(transformers' Jamba ignores it; only None is served)"
            )
        kinds = list(cfg.layers_block_type)
        unknown = sorted(set(kinds) - {ATTENTION_KIND, MAMBA_KIND})
        if unknown:
            raise ValueError(f"layers_block_type has unsupported entries {unknown}")
        mamba_dims(cfg).validate()
        if ATTENTION_KIND in kinds and cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={cfg.num_key_value_heads}"
            )

    def _build_layers(
        self, cfg: Any, dtype: torch.dtype, sites: StateSites
    ) -> tuple[list[HybridDecoderLayer], RMSNorm]:
        layers = []
        for kind, num_experts in zip(cfg.layers_block_type, cfg.layers_num_experts):
            mixer: nn.Module
            if kind == ATTENTION_KIND:
                name, mixer = "self_attn", Attention(attention_dims(cfg), dtype)
            else:
                name, mixer = "mamba", Mamba1Mixer(mamba_dims(cfg), dtype)
            layers.append(
                HybridDecoderLayer(
                    name,
                    mixer,
                    sites.add(mixer),
                    {"feed_forward": build_ffn(cfg, num_experts, dtype)},
                    RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                    RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                    post_norm_name="pre_ff_layernorm",
                )
            )
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return None  # attention without positional encoding

    def checkpoint_name(self, name: str) -> str:
        """The MoE router is ``feed_forward.router`` in Jamba, ``gate`` in our SparseMoE."""
        return name.replace(".feed_forward.router.", ".feed_forward.gate.")

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Experts fused as transformers holds them (``experts.gate_up_proj`` / ``down_proj``)
        load too: split into the per-expert layout, then renamed."""
        return super().checkpoint_tensors(unfuse_expert_tensors(weights))
