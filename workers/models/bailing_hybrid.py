"""BailingHybrid / Ling 3 (``BailingHybridForCausalLM``): KDA + MLA with RoPE, MoE.

Kimi-Linear's layer structure (``workers/models/kimi_linear.py``) with three differences:
the KDA gates (``kda_safe_gate``: ``kda_lower_bound * sigmoid(exp(A_log) * (f_proj(x) +
dt_bias))``, else ``-exp(A_log) * softplus(...)``; output gate ``g_proj(x)``; A_log [H]);
MLA with DeepSeek's interleaved RoPE on its rope part (``rope_parameters``, default type
only; yarn's softmax-scale correction would need ``mscale``, refused with the type named)
and a per-head sigmoid output gate (``g_proj``); the KDA heads are ``num_attention_heads``
of ``head_dim`` (transformers' ``linear_num_heads`` / ``linear_head_dim``).

Checkpoint layout (what ``save_pretrained`` writes, the released one): ``word_embeddings``,
``attention`` for ``self_attn``, ``dense`` for ``o_proj``, ``gate.expert_bias`` for the
score-correction bias, per-expert ``experts.{e}.{gate,up,down}_proj``, separate q/k/v convs.
MTP layers (``num_mtp_layers``, stored as ``model.layers.{N ..}`` after the
``num_hidden_layers`` decoder layers) load and are kept aside, and ``spec.method: mtp`` is
refused: transformers ignores them and defines no layout to check them against.

Config fields read: those of Kimi-Linear (``head_dim`` for ``linear_head_dim``,
``short_conv_kernel_size`` for ``linear_conv_kernel_dim``) plus ``kda_safe_gate``,
``kda_lower_bound``, ``rope_parameters`` / ``rope_theta``, ``num_mtp_layers``, the per-layer
``expert_swiglu_limit_list`` / ``share_expert_swiglu_limit_list`` (a sparse layer's routed /
shared experts clip their SwiGLU at the limit, 0 = off, as transformers 5.25 does; 5.24 ignores
them); ``layer_group_size`` and ``first_k_dense_replace`` arrive as ``layer_types`` /
``mlp_layer_types``. Not math: ``mtp_loss_scaling_factor``, dropout, init, router loss.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from workers.models.base import HybridDecoderLayer, HybridForCausalLM, check_hybrid_layer_types, default_rope
from workers.models.deepseek_moe import SwigluLimits, check_mlp_layer_types, with_swiglu_limits
from workers.models.kimi_linear import build_kda_mla_layers, check_mla_heads, kda_dims, mla_dims, rename_experts
from workers.models.layers import RMSNorm, RotaryEmbedding
from workers.models.weights import merge_split_tensors
from workers.state_spec import StateSites

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_RENAMES = (
    (".attention.", ".self_attn."),
    (".self_attn.dense.", ".self_attn.o_proj."),
    (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"),
    (".forget_gate.", "."),
)
LIMIT_FIELDS = ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list")  # routed, shared


def limit_list(cfg: Any, field: str) -> list[float]:
    """One of ``LIMIT_FIELDS``: a limit >= 0 per decoder layer (absent: all 0, no clipping)."""
    raw = getattr(cfg, field, None)
    if raw is None:
        return [0.0] * cfg.num_hidden_layers
    if not isinstance(raw, (list, tuple)) or len(raw) != cfg.num_hidden_layers:
        raise ValueError(f"{field}={raw!r} must list one limit per layer (num_hidden_layers={cfg.num_hidden_layers})")
    bad = [v for v in raw if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0]
    if bad:
        raise ValueError(f"{field} has entries {bad}: each limit must be a number >= 0 (0 = off)")
    return [float(v) for v in raw]


def swiglu_limits(cfg: Any) -> list[SwigluLimits]:
    return [SwigluLimits(r, s) for r, s in zip(*(limit_list(cfg, f) for f in LIMIT_FIELDS))]


class BailingHybridForCausalLM(HybridForCausalLM):
    ties_embeddings = False
    embed_name = "word_embeddings"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_hybrid_layer_types(cfg)
        check_mlp_layer_types(cfg)
        check_mla_heads(cfg)
        mla_dims(cfg, "interleaved", head_gate=True).validate()
        default_rope(cfg, cfg.qk_rope_head_dim, partial_factor=1.0)
        swiglu_limits(cfg)

    def _build_layers(
        self, cfg: Any, dtype: torch.dtype, sites: StateSites
    ) -> tuple[list[HybridDecoderLayer], RMSNorm]:
        gate = "bailing" if cfg.kda_safe_gate else "bailing_softplus"
        kda = kda_dims(cfg, gate, float(cfg.kda_lower_bound))
        layers, norm = build_kda_mla_layers(cfg, dtype, sites, kda, mla_dims(cfg, "interleaved", head_gate=True))
        for layer, limits in zip(layers, swiglu_limits(cfg)):
            layer.mlp = with_swiglu_limits(layer.mlp, limits)
        return layers, norm

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return default_rope(cfg, cfg.qk_rope_head_dim, partial_factor=1.0)

    def checkpoint_name(self, name: str) -> str:
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= self.config.num_hidden_layers:
            mtp = int(layer.group(1)) - self.config.num_hidden_layers
            return f"mtp.layers.{mtp}.{name[layer.end() :]}"  # kept aside (mtp_weights)
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return rename_experts(name)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return super().checkpoint_tensors(merge_split_tensors(weights))  # q, k, v convs

    def build_mtp_head(self, kv_index: int) -> nn.Module:
        """Refused: with MTP layers in the checkpoint, saying why (see the module docstring)."""
        if not self.mtp_weights:
            return super().build_mtp_head(kv_index)
        raise ValueError(
            f"spec.method 'mtp' is not supported for BailingHybrid (num_mtp_layers="
            f"{getattr(self.config, 'num_mtp_layers', 0)}, {len(self.mtp_weights)} tensors "
            "after the decoder layers): transformers 5.24 ignores them and defines no "
            "layout to check them against"
        )
