"""LFM2 (``Lfm2ForCausalLM``) and LFM2-MoE (``Lfm2MoeForCausalLM``): gated short
convolutions with attention at ``layer_types == "full_attention"``.

Layer i: ``operator_norm`` -> ``conv`` (the gated short conv, ``workers/models/short_conv.py``)
or ``self_attn`` (GQA, plain per-head ``q_layernorm`` / ``k_layernorm`` before RoPE, no bias,
``out_proj``) + residual; ``ffn_norm`` -> ``feed_forward`` + residual. The feed-forward is a
SwiGLU ``w2(silu(w1 x) * w3 x)``; LFM2 sizes it from ``intermediate_size`` with
``block_auto_adjust_ff_dim`` (2/3, then ``block_ffn_dim_multiplier`` and rounding up to
``block_multiple_of``), LFM2-MoE uses ``intermediate_size`` as is for its first
``num_dense_layers`` layers and a sigmoid-routed MoE (``expert_bias`` for the choice only when
``use_expert_bias``, ``norm_topk_prob`` with transformers' +1e-6, ``routed_scaling_factor``,
``moe_intermediate_size``) after. ``model.embedding_norm`` is the final norm (applied after
the last layer, despite its name); ``lm_head`` tied when ``tie_word_embeddings``.

Config fields read: ``layer_types`` (or LFM2's ``full_attn_idxs``, which transformers turns
into it), ``conv_L_cache``, ``conv_bias``, ``norm_eps``, ``rope_parameters`` (default RoPE
over the whole head only: another type or a ``partial_rotary_factor`` is refused),
``head_dim`` when given, the sizes above. Not math: ``max_position_embeddings``,
``use_cache``, ``output_router_logits``, init fields.

Checkpoint names kept by renaming on load (``checkpoint_name``): ``q_layernorm`` /
``k_layernorm`` / ``out_proj`` of attention, ``w1`` / ``w3`` / ``w2`` of the MLPs and experts,
the block's ``expert_bias``. LFM2-MoE experts also load fused (``experts.gate_up_proj`` /
``experts.down_proj``, transformers' in-memory layout).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from workers.models.base import FULL_ATTENTION, HybridForCausalLM, default_rope
from workers.models.layers import Attention, AttentionDims, DenseMLP, LayerContext, RMSNorm, RotaryEmbedding
from workers.models.mamba2_config import head_dim
from workers.models.moe import MoeDims, SparseMoE, unfuse_expert_tensors
from workers.models.short_conv import ShortConv, ShortConvDims
from workers.state_spec import StateRef, StateSites

CONV = "conv"
# checkpoint name -> our module's name (the SwiGLU's w1/w3/w2, LFM2's attention names)
MLP_RENAMES = (
    (re.compile(r"(\.feed_forward\.(?:experts\.\d+\.)?)w1\."), r"\1gate_proj."),
    (re.compile(r"(\.feed_forward\.(?:experts\.\d+\.)?)w3\."), r"\1up_proj."),
    (re.compile(r"(\.feed_forward\.(?:experts\.\d+\.)?)w2\."), r"\1down_proj."),
    (re.compile(r"\.feed_forward\.expert_bias$"), ".feed_forward.gate.e_score_correction_bias"),
)
ATTENTION_RENAMES = (
    (re.compile(r"\.self_attn\.q_layernorm\."), ".self_attn.q_norm."),
    (re.compile(r"\.self_attn\.k_layernorm\."), ".self_attn.k_norm."),
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
)


class LfmDecoderLayer(nn.Module):
    """``operator_norm`` -> mixer (``conv`` | ``self_attn``) [-> ``post_operator_norm``] +
    residual; ``ffn_norm`` -> ``feed_forward`` [-> ``post_ffn_norm``] + residual (the post
    norms are Lfm3's sandwich norms). ``rotary``: the layer's own RoPE, computed in fp32 for
    it (Lfm3 has one per attention layer type); None: the model's tables in ``ctx``."""

    def __init__(
        self,
        mixer_name: str,
        mixer: nn.Module,
        ref: StateRef,
        feed_forward: nn.Module,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        sandwich: bool = False,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.add_module(mixer_name, mixer)
        self.feed_forward = feed_forward
        self.operator_norm = RMSNorm(hidden_size, eps, dtype)
        self.ffn_norm = RMSNorm(hidden_size, eps, dtype)
        self.post_operator_norm = RMSNorm(hidden_size, eps, dtype) if sandwich else None
        self.post_ffn_norm = RMSNorm(hidden_size, eps, dtype) if sandwich else None
        self.mixer_name, self.ref, self.rotary = mixer_name, ref, rotary

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        if self.rotary is not None:
            ctx = ctx._replace(rope=self.rotary.tables(ctx.batch.positions, torch.float32))
        x = getattr(self, self.mixer_name)(self.operator_norm(hidden), ctx, self.ref)
        if self.post_operator_norm is not None:
            x = self.post_operator_norm(x)
        hidden = hidden + x
        x = self.feed_forward(self.ffn_norm(hidden))
        if self.post_ffn_norm is not None:
            x = self.post_ffn_norm(x)
        return hidden + x


def check_layer_types(cfg: Any, allowed: tuple[str, ...]) -> list[str]:
    kinds = list(cfg.layer_types or [])
    if len(kinds) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries, num_hidden_layers={cfg.num_hidden_layers}")
    unknown = sorted(set(kinds) - set(allowed))
    if unknown:
        raise ValueError(f"layer_types has unsupported entries {unknown}; expected {allowed}")
    if CONV in kinds and cfg.conv_L_cache < 2:
        raise ValueError(f"conv_L_cache={cfg.conv_L_cache} must be at least 2")
    if any(k != CONV for k in kinds) and cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple "
            f"of num_key_value_heads={cfg.num_key_value_heads}"
        )
    return kinds


def short_conv(cfg: Any, dtype: torch.dtype) -> ShortConv:
    return ShortConv(
        ShortConvDims(
            hidden_size=cfg.hidden_size,
            channels=cfg.hidden_size,
            conv_kernel=cfg.conv_L_cache,
            bias=bool(cfg.conv_bias),
        ),
        dtype,
    )


def lfm2_attention_dims(cfg: Any, bias: bool = False, **extra: Any) -> AttentionDims:
    """LFM attention: plain per-head q/k RMSNorms at ``norm_eps``; no bias in LFM2 (its
    attention has none whatever the config says), Lfm3 passes ``attention_bias``."""
    hd = head_dim(cfg)
    return AttentionDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=hd,
        bias=bias,
        scale=hd**-0.5,
        qk_norm_eps=cfg.norm_eps,
        qk_norm_zero_centered=False,
        **extra,
    )


def lfm2_intermediate_size(cfg: Any) -> int:
    """transformers' ``Lfm2MLP`` sizing (``block_auto_adjust_ff_dim``)."""
    size = cfg.intermediate_size
    if cfg.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if cfg.block_ffn_dim_multiplier is not None:
            size = int(cfg.block_ffn_dim_multiplier * size)
            multiple = cfg.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


def rename(name: str, renames: tuple[tuple[re.Pattern[str], str], ...]) -> str:
    for pattern, replacement in renames:
        name = pattern.sub(replacement, name)
    return name


class Lfm2ForCausalLM(HybridForCausalLM):
    final_norm_name = "embedding_norm"
    renames = MLP_RENAMES + ATTENTION_RENAMES

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        kinds = check_layer_types(cfg, (CONV, FULL_ATTENTION))
        if FULL_ATTENTION in kinds:
            default_rope(cfg, head_dim(cfg), partial_factor=1.0)
            partial = (cfg.rope_parameters or {}).get("partial_rotary_factor")
            if partial is not None and float(partial) != 1.0:
                raise ValueError(
                    f"rope_parameters.partial_rotary_factor={partial} is not "
                    "supported (transformers' LFM2 rotates the whole head and "
                    "ignores it; only 1.0 is served)"
                )

    def _build_ffn(self, cfg: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return DenseMLP(cfg.hidden_size, lfm2_intermediate_size(cfg), dtype)

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[LfmDecoderLayer], RMSNorm]:
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            mixer: nn.Module
            if kind == CONV:
                name, mixer = CONV, short_conv(cfg, dtype)
            else:
                name, mixer = "self_attn", Attention(lfm2_attention_dims(cfg), dtype)
            layers.append(
                LfmDecoderLayer(
                    name, mixer, sites.add(mixer), self._build_ffn(cfg, i, dtype), cfg.hidden_size, cfg.norm_eps, dtype
                )
            )
        return layers, RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        if FULL_ATTENTION not in cfg.layer_types:
            return None
        return default_rope(cfg, head_dim(cfg), partial_factor=1.0)

    def checkpoint_name(self, name: str) -> str:
        return rename(name, self.renames)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        super().validate_config(cfg)
        if not 0 <= cfg.num_dense_layers <= cfg.num_hidden_layers:
            raise ValueError(
                f"num_dense_layers={cfg.num_dense_layers} is outside 0..num_hidden_layers={cfg.num_hidden_layers}"
            )
        if cfg.num_dense_layers < cfg.num_hidden_layers:
            moe_dims(cfg).validate()

    def _build_ffn(self, cfg: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if layer_idx < cfg.num_dense_layers:
            return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        return SparseMoE(moe_dims(cfg), dtype)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Experts fused as transformers holds them load too (split per expert first)."""
        return super().checkpoint_tensors(unfuse_expert_tensors(weights))


def moe_dims(cfg: Any) -> MoeDims:
    return MoeDims(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        style="sigmoid_grouped",
        norm_topk_prob=bool(cfg.norm_topk_prob),
        routed_scaling_factor=float(cfg.routed_scaling_factor),
        score_bias=bool(cfg.use_expert_bias),
        norm_eps=1e-6,
    )
