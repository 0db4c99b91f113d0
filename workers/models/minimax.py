"""MiniMax-Text-01 (``MiniMaxForCausalLM``): lightning attention + softmax attention, MoE.

Layer i normalises first and keeps the *normed* stream as its residual (DeepNet style):

    x = input_layernorm(h);  h = x * attn_alpha + self_attn(x) * attn_beta
    x = post_attention_layernorm(h);  h = x * mlp_alpha + mlp(x) * mlp_beta

with (alpha, beta) = ``linear_attn_{alpha,beta}_factor`` after lightning attention
(``linear_attention`` layers: ``workers/models/lightning.py``), ``full_attn_*`` after GQA
softmax attention with RoPE over the whole head (``full_attention``), ``mlp_*`` after the
MoE: softmax over ``num_local_experts``, top ``num_experts_per_tok``, always renormalised,
SwiGLU experts of ``intermediate_size``, no shared expert. Plain RMSNorms.

Checkpoint layout (what ``save_pretrained`` writes, the released one): ``block_sparse_moe``
with experts ``w1`` / ``w3`` / ``w2`` (gate / up / down); the lightning layers' saved buffers
are read as ``LightningAttention`` explains.

Config fields read: ``hidden_size``, ``num_hidden_layers``, ``layer_types``,
``num_attention_heads`` (both attentions), ``num_key_value_heads``, ``head_dim``,
``hidden_act`` (lightning's q/k/v activation and the experts': only what ``ACTIVATIONS``
has), ``rms_norm_eps``, ``rope_parameters`` (default type; transformers' MiniMax rotates the
whole head whatever ``partial_rotary_factor`` says), the six alpha/beta factors,
``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size``, ``block_size`` (only to
check the saved tables), ``tie_word_embeddings``. Refused: ``sliding_window`` (not served).
Not math: ``router_jitter_noise`` (training only), router-loss, dropout, init fields.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.models.base import FULL_ATTENTION, HybridForCausalLM, check_hybrid_layer_types, default_rope
from workers.models.kimi_linear import rename_experts
from workers.models.layers import Attention, AttentionDims, LayerContext, RMSNorm, RotaryEmbedding, activation
from workers.models.lightning import LightningAttention, LightningDims
from workers.models.moe import MoeDims, SparseMoE
from workers.state_spec import StateRef, StateSites


def head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class MiniMaxDecoderLayer(nn.Module):
    """See the module docstring; ``factors`` = (attn alpha, attn beta, mlp alpha, mlp beta)."""

    def __init__(
        self,
        mixer: nn.Module,
        ref: StateRef,
        mlp: nn.Module,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
        factors: tuple[float, float, float, float],
    ) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = mixer
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self.ref = ref
        self.factors = factors

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        attn_alpha, attn_beta, mlp_alpha, mlp_beta = self.factors
        x = self.input_layernorm(hidden)
        hidden = x * attn_alpha + self.self_attn(x, ctx, self.ref) * attn_beta
        x = self.post_attention_layernorm(hidden)
        return x * mlp_alpha + self.mlp(x) * mlp_beta


def _factors(cfg: Any, kind: str) -> tuple[float, float, float, float]:
    attn = "full_attn" if kind == FULL_ATTENTION else "linear_attn"
    return (
        float(getattr(cfg, f"{attn}_alpha_factor")),
        float(getattr(cfg, f"{attn}_beta_factor")),
        float(cfg.mlp_alpha_factor),
        float(cfg.mlp_beta_factor),
    )


class MiniMaxForCausalLM(HybridForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hf_config, dtype, device)
        for module in self.modules():
            if isinstance(module, LightningAttention):
                module.init_slope()

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_hybrid_layer_types(cfg)
        activation(cfg.hidden_act)
        if getattr(cfg, "sliding_window", None) is not None:
            raise ValueError(f"sliding_window={cfg.sliding_window} is not supported (full causal attention only)")
        default_rope(cfg, head_dim(cfg), partial_factor=1.0)

    def _build_layers(
        self, cfg: Any, dtype: torch.dtype, sites: StateSites
    ) -> tuple[list[MiniMaxDecoderLayer], RMSNorm]:
        hd = head_dim(cfg)
        moe = MoeDims(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_experts=cfg.num_local_experts,
            top_k=cfg.num_experts_per_tok,
            style="qwen",
            norm_topk_prob=True,
            act=cfg.hidden_act,
        )
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            mixer: nn.Module
            if kind == FULL_ATTENTION:
                mixer = Attention(
                    AttentionDims(
                        hidden_size=cfg.hidden_size,
                        num_heads=cfg.num_attention_heads,
                        num_kv_heads=cfg.num_key_value_heads,
                        head_dim=hd,
                        bias=False,
                        scale=hd**-0.5,
                    ),
                    dtype,
                )
            else:
                mixer = LightningAttention(
                    LightningDims(
                        hidden_size=cfg.hidden_size,
                        num_heads=cfg.num_attention_heads,
                        head_dim=hd,
                        layer_idx=i,
                        num_layers=cfg.num_hidden_layers,
                        block_size=cfg.block_size,
                        act=cfg.hidden_act,
                    ),
                    dtype,
                )
            layers.append(
                MiniMaxDecoderLayer(
                    mixer,
                    sites.add(mixer),
                    SparseMoE(moe, dtype),
                    RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                    RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                    _factors(cfg, kind),
                )
            )
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return default_rope(cfg, head_dim(cfg), partial_factor=1.0)

    def checkpoint_name(self, name: str) -> str:
        return rename_experts(name.replace(".block_sparse_moe.", ".mlp."))

    def load_weights(self, weights: Any) -> None:
        super().load_weights(weights)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.self_attn, LightningAttention):
                layer.self_attn.check_loaded_tables(f"model.layers.{i}.self_attn.")
