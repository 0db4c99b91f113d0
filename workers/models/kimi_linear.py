"""Kimi-Linear (``KimiLinearForCausalLM``): Kimi Delta Attention + MLA without positions, MoE.

Layer i is pre-norm ``hidden + self_attn(norm(hidden))``, then ``hidden + mlp(norm(hidden))``.
``self_attn`` is, by ``layer_types[i]``, KDA (``linear_attention``: ``workers/models/kda.py``,
Kimi's low-rank gates) or MLA (``full_attention``: ``workers/models/mla.py``) with no
positional encoding at all (the rope part of the key is used unrotated, as transformers
does). ``mlp`` is, by ``mlp_layer_types[i]``, a SwiGLU MLP or the DeepSeek-V3 MoE
(``workers/models/deepseek_moe.py``). Plain RMSNorms; ``lm_head`` never tied (transformers'
class ties nothing). No MTP layers in this architecture: ``spec.method: mtp`` is refused.

Checkpoint layout: what ``save_pretrained`` writes (the released one): ``block_sparse_moe``
for every feed-forward, experts ``w1`` / ``w3`` / ``w2`` (gate / up / down), separate
``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, ``A_log`` [1, 1, H, 1]; transformers' runtime
names for the forget gate (``forget_gate.*``) load too.

Config fields read: ``hidden_size``, ``num_hidden_layers``, ``layer_types``,
``mlp_layer_types``, ``hidden_act`` (MLPs, experts and the KDA conv: only silu),
``rms_norm_eps`` (model norms and the KDA output norm), ``linear_num_heads``,
``linear_head_dim``, ``linear_conv_kernel_dim``, ``num_attention_heads``,
``num_key_value_heads`` (must equal the heads: MLA shares one latent), ``q_lora_rank``,
``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``attention_bias``, ``intermediate_size``, ``moe_intermediate_size``, ``num_local_experts``,
``num_experts_per_tok``, ``n_group``, ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``, ``n_shared_experts``, ``vocab_size``. Not math: dropout, init,
``pretraining_tp``, router-loss and cache fields.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from workers.models.base import FULL_ATTENTION, HybridDecoderLayer, HybridForCausalLM, check_hybrid_layer_types
from workers.models.deepseek_moe import build_ffn, check_mlp_layer_types
from workers.models.kda import KdaDims, KimiDeltaAttention
from workers.models.layers import RMSNorm, RotaryEmbedding
from workers.models.mla import LatentAttention, MlaDims
from workers.models.weights import merge_split_tensors
from workers.state_spec import StateSites

# released (save_pretrained) names -> ours
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w[123])\.")


def check_mla_heads(cfg: Any) -> None:
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ValueError(
            f"num_key_value_heads={cfg.num_key_value_heads} differs from "
            f"num_attention_heads={cfg.num_attention_heads}: MLA keys and values come "
            "from one latent per token, expanded to every head (transformers repeats "
            "them num_attention_heads / num_key_value_heads times more, which breaks)"
        )
    if cfg.q_lora_rank is not None and cfg.q_lora_rank <= 0:
        raise ValueError(f"q_lora_rank={cfg.q_lora_rank} must be positive or null")


def mla_dims(cfg: Any, rope: str, head_gate: bool = False) -> MlaDims:
    return MlaDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        q_lora_rank=cfg.q_lora_rank,
        bias=bool(cfg.attention_bias),
        rope=rope,
        head_gate=head_gate,
    )


def kda_dims(cfg: Any, gate: str, lower_bound: float = -5.0) -> KdaDims:
    return KdaDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.linear_num_heads,
        head_dim=cfg.linear_head_dim,
        conv_kernel=cfg.linear_conv_kernel_dim,
        eps=cfg.rms_norm_eps,
        gate=gate,
        gate_lower_bound=lower_bound,
    )


def build_kda_mla_layers(
    cfg: Any, dtype: torch.dtype, sites: StateSites, kda: KdaDims, mla: MlaDims
) -> tuple[list[HybridDecoderLayer], RMSNorm]:
    """The layers of both KDA + MLA families (Kimi-Linear, BailingHybrid)."""
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        mixer = LatentAttention(mla, dtype) if kind == FULL_ATTENTION else KimiDeltaAttention(kda, dtype)
        layers.append(
            HybridDecoderLayer(
                "self_attn",
                mixer,
                sites.add(mixer),
                {"mlp": build_ffn(cfg, i, dtype)},
                RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
            )
        )
    return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


def rename_experts(name: str) -> str:
    return _EXPERT.sub(lambda m: f".experts.{m.group(1)}.{_EXPERT_NAMES[m.group(2)]}.", name)


class KimiLinearForCausalLM(HybridForCausalLM):
    ties_embeddings = False

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_hybrid_layer_types(cfg)
        check_mlp_layer_types(cfg)
        check_mla_heads(cfg)
        mla_dims(cfg, "none").validate()

    def _build_layers(
        self, cfg: Any, dtype: torch.dtype, sites: StateSites
    ) -> tuple[list[HybridDecoderLayer], RMSNorm]:
        return build_kda_mla_layers(cfg, dtype, sites, kda_dims(cfg, "kimi"), mla_dims(cfg, "none"))

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return None  # MLA without positional encoding

    def checkpoint_name(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".forget_gate.", ".")
        return rename_experts(name)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return super().checkpoint_tensors(merge_split_tensors(weights))  # q, k, v convs
