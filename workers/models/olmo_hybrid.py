"""OLMo Hybrid (``OlmoHybridForCausalLM``): Gated DeltaNet + OLMo-3 attention, dense MLPs.

``linear_attention`` layers are pre-norm (``input_layernorm``, ``post_attention_layernorm``)
around ``linear_attn``: Qwen3-Next's Gated DeltaNet math (``kernels.gdn`` as it is; the layer
is Qwen3.5's unfused one under OLMo's names) with separate projections ``q_proj``, ``k_proj``,
``v_proj``, ``a_proj``, ``b_proj``, the output gate ``g_proj``, ``beta = 2 sigmoid(b)`` when
``linear_allow_neg_eigval`` (negative eigenvalues of the transition), the output norm's eps
fixed at 1e-5 (transformers' choice) and ``o_proj``. ``full_attention`` layers are post-norm, OLMo-3's:

    h = h + post_attention_layernorm(self_attn(h));  h = h + post_feedforward_layernorm(mlp(h))

with q and k RMS-normalised over *all* their heads (``q_norm`` [H D], ``k_norm`` [H_kv D])
before RoPE; RoPE only when ``rope_parameters`` has a ``rope_theta`` (the released
checkpoints have none: NoPE). SwiGLU MLPs, plain RMSNorms, tied embeddings honoured.

Checkpoint layout (what ``save_pretrained`` writes): ``attention_layer_norm`` /
``feedforward_layer_norm`` for the first two norms of a layer (``input_layernorm`` /
``post_attention_layernorm``; an attention layer's ``post_attention_layernorm`` too), separate
``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, merged in that order whatever their lengths
(``save_pretrained`` splits the merged conv into equal thirds even when the value width
differs from the key width; released checkpoints split it at the widths).

Config fields read: ``hidden_size``, ``num_hidden_layers``, ``layer_types``,
``num_attention_heads``, ``num_key_value_heads``, ``attention_bias``, ``rope_parameters``,
``rms_norm_eps``, ``hidden_act`` (MLP and conv: only silu), ``intermediate_size``,
``linear_num_key_heads`` / ``linear_num_value_heads`` (must be equal: transformers' kernel
call does not repeat key heads), ``linear_key_head_dim``, ``linear_value_head_dim``,
``linear_conv_kernel_dim``, ``linear_allow_neg_eigval``, ``tie_word_embeddings``. Not math:
the ``linear_a_log_*`` / ``linear_dt_*`` init ranges, dropout, init.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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
from workers.models.gated_deltanet import GdnDims, SplitGatedDeltaNet
from workers.models.layers import Attention, AttentionDims, DenseMLP, LayerContext, RMSNorm, RotaryEmbedding
from workers.models.weights import WeightTarget, merge_split_tensors, whole
from workers.state_spec import StateRef, StateSites

GDN_NORM_EPS = 1e-5


class OlmoGatedDeltaNet(SplitGatedDeltaNet):
    """Qwen3.5's unfused GDN under OLMo's names: ``in_proj_qkv`` = [q_proj | k_proj | v_proj],
    ``in_proj_z`` = ``g_proj``, ``in_proj_b`` / ``in_proj_a`` = ``b_proj`` / ``a_proj``,
    ``norm`` / ``out_proj`` = ``o_norm`` / ``o_proj``; so it shards as Qwen3.5's does."""

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """``conv1d.weight`` is the q, k, v convs merged (``weights.merge_split_tensors``)."""
        d = self.dims
        key_dim = d.num_k_heads * d.k_head_dim
        qkv = self.in_proj_qkv.weight
        parts = {
            "q_proj": qkv[:key_dim],
            "k_proj": qkv[key_dim : 2 * key_dim],
            "v_proj": qkv[2 * key_dim :],
            "g_proj": self.in_proj_z.weight,
            "b_proj": self.in_proj_b.weight,
            "a_proj": self.in_proj_a.weight,
            "conv1d": self.conv1d.weight,
            "o_norm": self.norm.weight,
            "o_proj": self.out_proj.weight,
        }
        targets = {f"{prefix}{name}.weight": whole(t) for name, t in parts.items()}
        targets.update({f"{prefix}A_log": whole(self.A_log), f"{prefix}dt_bias": whole(self.dt_bias)})
        return targets


class OlmoAttention(Attention):
    """GQA whose q and k are RMS-normalised over all their heads before RoPE (OLMo-2/3)."""

    def __init__(self, dims: AttentionDims, eps: float, dtype: torch.dtype) -> None:
        super().__init__(dims, dtype)
        self.q_norm: nn.Module = RMSNorm(dims.num_heads * dims.head_dim, eps, dtype)
        self.k_norm: nn.Module = RMSNorm(dims.num_kv_heads * dims.head_dim, eps, dtype)

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef, adapter: int | None = None) -> torch.Tensor:
        return self.attend(self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x), ctx, ref)


class PostNormDecoderLayer(nn.Module):
    """OLMo's attention layer: norms after the attention and after the MLP, on the branch."""

    def __init__(self, attn: OlmoAttention, ref: StateRef, mlp: DenseMLP, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(mlp.down_proj.out_features, eps, dtype)
        self.post_feedforward_layernorm = RMSNorm(mlp.down_proj.out_features, eps, dtype)
        self.ref = ref

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, ctx, self.ref))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


def gdn_dims(cfg: Any) -> GdnDims:
    return GdnDims(
        hidden_size=cfg.hidden_size,
        num_k_heads=cfg.linear_num_key_heads,
        num_v_heads=cfg.linear_num_value_heads,
        k_head_dim=cfg.linear_key_head_dim,
        v_head_dim=cfg.linear_value_head_dim,
        conv_kernel=cfg.linear_conv_kernel_dim,
        eps=GDN_NORM_EPS,
        beta_scale=2.0 if cfg.linear_allow_neg_eigval else 1.0,
    )


def attention_dims(cfg: Any) -> AttentionDims:
    hd = cfg.hidden_size // cfg.num_attention_heads
    return AttentionDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=hd,
        bias=bool(cfg.attention_bias),
        scale=hd**-0.5,
    )


def uses_rope(cfg: Any) -> bool:
    params = getattr(cfg, "rope_parameters", None)
    return params is not None and params.get("rope_theta") is not None


class OlmoHybridForCausalLM(HybridForCausalLM):
    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_hybrid_layer_types(cfg)
        if cfg.linear_num_key_heads != cfg.linear_num_value_heads:
            raise ValueError(
                f"linear_num_key_heads={cfg.linear_num_key_heads} differs from "
                f"linear_num_value_heads={cfg.linear_num_value_heads}: transformers' "
                "OLMo Hybrid passes the heads to its kernel without repeating them"
            )
        if uses_rope(cfg):
            default_rope(cfg, attention_dims(cfg).head_dim, partial_factor=1.0)

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], RMSNorm]:
        eps, layers = cfg.rms_norm_eps, []
        for kind in cfg.layer_types:
            mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, act=cfg.hidden_act)
            if kind == FULL_ATTENTION:
                attn = OlmoAttention(attention_dims(cfg), eps, dtype)
                layers.append(PostNormDecoderLayer(attn, sites.add(attn), mlp, eps, dtype))
            else:
                gdn = OlmoGatedDeltaNet(gdn_dims(cfg), dtype)
                layers.append(
                    HybridDecoderLayer(
                        "linear_attn",
                        gdn,
                        sites.add(gdn),
                        {"mlp": mlp},
                        RMSNorm(cfg.hidden_size, eps, dtype),
                        RMSNorm(cfg.hidden_size, eps, dtype),
                    )
                )
        return layers, RMSNorm(cfg.hidden_size, eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return default_rope(cfg, attention_dims(cfg).head_dim, partial_factor=1.0) if uses_rope(cfg) else None

    def checkpoint_name(self, name: str) -> str:
        return name.replace(".attention_layer_norm.", ".input_layernorm.").replace(
            ".feedforward_layer_norm.", ".post_attention_layernorm."
        )

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return super().checkpoint_tensors(merge_split_tensors(weights))  # q, k, v convs
