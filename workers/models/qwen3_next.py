"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet + gated attention, MoE, MTP head.

Layer i is ``linear_attention`` (GDN, ``linear_attn``) or ``full_attention`` (``self_attn``:
q_proj emits query and a sigmoid output gate per head, zero-centred per-head q/k norms,
partial RoPE), then an MoE (``mlp``: softmax top-k experts + sigmoid-gated shared expert) or,
for ``mlp_only_layers`` / off the ``decoder_sparse_step`` grid, a dense SwiGLU MLP. Every
model RMSNorm is zero-centred (``1 + weight``). The checkpoint's ``mtp.*`` tensors are kept
in ``mtp_weights`` for ``build_mtp_head`` (``mtp_num_hidden_layers`` layers, see
``workers/models/mtp.py``).

The Qwen3.5 / 3.6 families (``qwen3_5.py``) subclass this one and replace only the
GDN projection layout, the feed-forward rule and the config checks (``gdn_class``,
``build_ffn``, ``build_mtp_ffn``, ``validate_config``).
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
from workers.models.gated_deltanet import GatedDeltaNet, GdnDims
from workers.models.layers import Attention, AttentionDims, DenseMLP, RMSNorm, RotaryEmbedding
from workers.models.moe import MoeDims, SparseMoE
from workers.models.mtp import MtpHead, mtp_layer_count
from workers.state_spec import StateRef, StateSites


def gdn_dims(cfg: Any) -> GdnDims:
    return GdnDims(
        hidden_size=cfg.hidden_size,
        num_k_heads=cfg.linear_num_key_heads,
        num_v_heads=cfg.linear_num_value_heads,
        k_head_dim=cfg.linear_key_head_dim,
        v_head_dim=cfg.linear_value_head_dim,
        conv_kernel=cfg.linear_conv_kernel_dim,
        eps=cfg.rms_norm_eps,
    )


def head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def attention_dims(cfg: Any) -> AttentionDims:
    hd = head_dim(cfg)
    return AttentionDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=hd,
        bias=bool(cfg.attention_bias),
        scale=hd**-0.5,
        output_gate=True,
        qk_norm_eps=cfg.rms_norm_eps,
    )


def is_moe_layer(cfg: Any, layer_idx: int) -> bool:
    return (
        layer_idx not in (cfg.mlp_only_layers or [])
        and cfg.num_experts > 0
        and (layer_idx + 1) % cfg.decoder_sparse_step == 0
    )


def qwen_moe(cfg: Any, dtype: torch.dtype, norm_topk_prob: bool) -> SparseMoE:
    dims = MoeDims(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        style="qwen",
        norm_topk_prob=norm_topk_prob,
        shared_intermediate_size=cfg.shared_expert_intermediate_size,
    )
    return SparseMoE(dims, dtype)


def decoder_layer(
    cfg: Any,
    kind: str,
    sites: StateSites | StateRef,
    gdn_class: type[GatedDeltaNet],
    ffn: nn.Module,
    dtype: torch.dtype,
) -> HybridDecoderLayer:
    """One decoder layer of the Qwen hybrids (also the shape of an MTP layer, which passes the
    ``StateRef`` of its KV instead of the model's ``StateSites``)."""

    def norm() -> RMSNorm:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, zero_centered=True)

    if kind == FULL_ATTENTION:
        name, mixer = "self_attn", Attention(attention_dims(cfg), dtype)
    else:
        name, mixer = "linear_attn", gdn_class(gdn_dims(cfg), dtype)
    ref = sites.add(mixer) if isinstance(sites, StateSites) else sites
    return HybridDecoderLayer(name, mixer, ref, {"mlp": ffn}, norm(), norm())


class Qwen3NextForCausalLM(HybridForCausalLM):
    gdn_class: type[GatedDeltaNet] = GatedDeltaNet

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_hybrid_layer_types(cfg)
        gdn_dims(cfg).validate()
        if FULL_ATTENTION in cfg.layer_types and cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={cfg.num_key_value_heads}"
            )
        default_rope(cfg, head_dim(cfg))
        mtp_layer_count(cfg, {})  # a malformed mtp_num_hidden_layers fails at load

    # --- family hooks (Qwen3.5 overrides) -----------------------------------------------
    @classmethod
    def build_ffn(cls, cfg: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if not is_moe_layer(cfg, layer_idx):
            return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        return qwen_moe(cfg, dtype, bool(cfg.norm_topk_prob))

    @classmethod
    def build_mtp_ffn(cls, cfg: Any, moe: bool, dtype: torch.dtype) -> nn.Module:
        """An MTP layer's feed-forward; ``moe``: its ``mtp.layers.{j}.mlp.experts.*`` exist."""
        if not moe:
            return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        return qwen_moe(cfg, dtype, bool(cfg.norm_topk_prob))

    # --- the model ----------------------------------------------------------------------
    def _build_layers(
        self, cfg: Any, dtype: torch.dtype, sites: StateSites
    ) -> tuple[list[HybridDecoderLayer], RMSNorm]:
        layers = [
            decoder_layer(cfg, kind, sites, self.gdn_class, self.build_ffn(cfg, i, dtype), dtype)
            for i, kind in enumerate(cfg.layer_types)
        ]
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, zero_centered=True)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return default_rope(cfg, head_dim(cfg))

    @property
    def num_mtp_layers(self) -> int:
        return mtp_layer_count(self.config, self.mtp_weights)

    def build_mtp_head(self, kv_index: int) -> MtpHead:
        cfg, dtype = self.config, self.dtype

        def layer(ref: StateRef, moe: bool) -> HybridDecoderLayer:
            return decoder_layer(cfg, FULL_ATTENTION, ref, self.gdn_class, self.build_mtp_ffn(cfg, moe, dtype), dtype)

        return MtpHead(self, kv_index, self.num_mtp_layers, layer)
