"""Nemotron-H (``NemotronHForCausalLM``): Mamba2 / attention / MLP / MoE blocks in a pattern.

Block i is ``hidden + mixer(norm(hidden))`` (``backbone.layers.{i}.norm`` / ``.mixer``) with
the mixer named by ``layers_block_type[i]`` (or the legacy ``hybrid_override_pattern``,
which transformers converts): ``linear_attention`` = the Mamba2 mixer (gate before the
norm, dt clamped to ``time_step_limit``), ``full_attention`` = GQA without positional
encoding, ``mlp`` = ``down(relu2(up(x)))`` without a gate, ``moe`` = sigmoid-routed, grouped
top-k experts of the same ungated MLP shape plus one shared expert (``NemotronHMoE``).
Names: ``backbone.embeddings``, ``backbone.norm_f``.

MTP: a checkpoint's ``mtp.*`` tensors (``num_nextn_predict_layers`` MTP layers of the blocks
``mtp_layers_block_type`` names, which transformers 5.24 drops on load) are kept in
``mtp_weights`` for ``build_mtp_head`` (``workers/models/nemotron_h_mtp.py``).

Fields that transformers ignores but that would mean other math are refused when set away
from their inert value: ``attention_bias``, ``sliding_window``, ``mamba_proj_bias`` (the
projections' bias is ``use_bias``), ``n_shared_experts`` != 1, ``residual_in_fp32``.
Not math: ``expand`` (d_inner is heads x head_dim), ``time_step_min`` / ``time_step_max`` /
``time_step_floor`` (dt_bias init; transformers 5.24 also clamped dt below at ``time_step_min``,
5.25 clamps with ``time_step_limit`` as mamba_ssm and vLLM do), dropout, init and kernel-choice
fields. ``tie_word_embeddings``: transformers' Nemotron-H never ties, so ``lm_head.weight`` is
always its own tensor here too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.models.base import FULL_ATTENTION, LINEAR_ATTENTION, HybridForCausalLM, MixerBlock
from workers.models.layers import Attention, AttentionDims, DenseMLP, RMSNorm, RotaryEmbedding, activation, linear
from workers.models.mamba2 import Mamba2Dims, Mamba2Mixer
from workers.models.mamba2_config import check_mamba_dims, time_step_limit
from workers.models.moe import MoeDims, SparseMoE
from workers.models.nemotron_h_mtp import NemotronHMtpHead, mtp_layout
from workers.models.weights import WeightTarget, module_targets
from workers.state_spec import StateSites

MLP, MOE = "mlp", "moe"
# field -> the value transformers' math amounts to (it does not read the field)
_INERT = {"attention_bias": False, "sliding_window": None, "residual_in_fp32": False, "n_shared_experts": 1}


def mamba_dims(cfg: Any) -> Mamba2Dims:
    return Mamba2Dims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.mamba_num_heads,
        head_dim=cfg.mamba_head_dim,
        state_size=cfg.ssm_state_size,
        num_groups=cfg.n_groups,
        conv_kernel=cfg.conv_kernel,
        conv_bias=bool(cfg.use_conv_bias),
        proj_bias=bool(cfg.use_bias),
        chunk_size=cfg.chunk_size,
        dt_limit=time_step_limit(cfg),
        eps=cfg.layer_norm_epsilon,
        ssm_dtype=str(cfg.mamba_ssm_cache_dtype),
    )


def attention_dims(cfg: Any) -> AttentionDims:
    return AttentionDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        bias=False,
        scale=cfg.head_dim**-0.5,
    )


def mlp(cfg: Any, intermediate_size: int, dtype: torch.dtype) -> DenseMLP:
    return DenseMLP(
        cfg.hidden_size, intermediate_size, dtype, act=cfg.mlp_hidden_act, gated=False, bias=bool(cfg.mlp_bias)
    )


def block_mixer(cfg: Any, kind: str, dtype: torch.dtype) -> nn.Module:
    """The mixer of a block of ``kind`` (a ``layers_block_type`` / ``mtp_layers_block_type`` entry)."""
    if kind == LINEAR_ATTENTION:
        return Mamba2Mixer(mamba_dims(cfg), dtype)
    if kind == FULL_ATTENTION:
        return Attention(attention_dims(cfg), dtype)
    if kind == MLP:
        return mlp(cfg, cfg.intermediate_size, dtype)
    if kind == MOE:
        return NemotronHMoE(cfg, dtype)
    raise ValueError(f"unsupported block type {kind!r}; expected one of {[LINEAR_ATTENTION, FULL_ATTENTION, MLP, MOE]}")


class NemotronHMoE(nn.Module):
    """Routed experts (on the optional ``moe_latent_size`` projection) + one shared expert.

    Checkpoint: ``gate.weight`` / ``gate.e_score_correction_bias`` (fp32 router),
    ``experts.{e}.{up,down}_proj.weight``, ``shared_experts.{up,down}_proj.*``,
    ``fc1_latent_proj`` / ``fc2_latent_proj`` with a latent size. Under TP the routed experts
    and the shared expert shard by their intermediate dims; the latent projections are
    replicated (fc2 reads the all-reduced expert sum).
    """

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        latent = cfg.moe_latent_size
        self.routed = SparseMoE(
            MoeDims(
                hidden_size=latent or cfg.hidden_size,
                intermediate_size=cfg.moe_intermediate_size,
                num_experts=cfg.n_routed_experts,
                top_k=cfg.num_experts_per_tok,
                style="sigmoid_grouped",
                norm_topk_prob=bool(cfg.norm_topk_prob),
                gated=False,
                act=cfg.mlp_hidden_act,
                router_size=cfg.hidden_size,
                num_groups=cfg.n_group,
                topk_groups=cfg.topk_group,
                routed_scaling_factor=float(cfg.routed_scaling_factor),
            ),
            dtype,
        )
        self.shared_experts = mlp(cfg, cfg.moe_shared_expert_intermediate_size, dtype)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent is not None:
            self.fc1_latent_proj = linear(cfg.hidden_size, latent, bool(cfg.mlp_bias), dtype)
            self.fc2_latent_proj = linear(latent, cfg.hidden_size, bool(cfg.mlp_bias), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc1_latent_proj is None:
            routed = self.routed(x)
        else:
            assert self.fc2_latent_proj is not None
            routed = self.fc2_latent_proj(self.routed(x, expert_input=self.fc1_latent_proj(x)))
        return routed + self.shared_experts(x)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = self.routed.weight_targets(prefix)
        targets.update(module_targets(self.shared_experts, f"{prefix}shared_experts."))
        for name in ("fc1_latent_proj", "fc2_latent_proj"):
            proj = getattr(self, name)
            if proj is not None:
                targets.update(module_targets(proj, f"{prefix}{name}."))
        return targets


class NemotronHForCausalLM(HybridForCausalLM):
    ties_embeddings = False
    checkpoint_prefix = "backbone."
    embed_name = "embeddings"
    final_norm_name = "norm_f"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        kinds = list(cfg.layers_block_type)
        unknown = sorted(set(kinds) - {LINEAR_ATTENTION, FULL_ATTENTION, MLP, MOE})
        if unknown:
            raise ValueError(f"layers_block_type has unsupported entries {unknown}")
        for field, inert in _INERT.items():
            if getattr(cfg, field, inert) != inert:
                raise ValueError(
                    f"{field}={getattr(cfg, field)!r} is not supported (transformers "
                    f"ignores it; only {inert!r} is served)"
                )
        if bool(getattr(cfg, "mamba_proj_bias", False)) != bool(cfg.use_bias):
            raise ValueError(
                f"mamba_proj_bias={cfg.mamba_proj_bias!r} differs from use_bias="
                f"{cfg.use_bias!r}, which transformers uses for the Mamba projections"
            )
        activation(cfg.mlp_hidden_act, "mlp_hidden_act")
        dims = mamba_dims(cfg)
        check_mamba_dims(cfg, dims, dims.d_inner, "mamba_num_heads * mamba_head_dim", "mamba_hidden_act")
        if FULL_ATTENTION in kinds:
            attention_dims(cfg)  # GQA divisibility is checked by the layer
        if MOE in kinds and cfg.moe_latent_size is not None and cfg.moe_latent_size <= 0:
            raise ValueError(f"moe_latent_size={cfg.moe_latent_size} must be positive")
        mtp_layout(cfg, {})  # a malformed num_nextn_predict_layers fails at load

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[MixerBlock], RMSNorm]:
        layers = []
        for kind in cfg.layers_block_type:
            mixer = block_mixer(cfg, kind, dtype)
            ref = sites.add(mixer) if kind in (LINEAR_ATTENTION, FULL_ATTENTION) else None
            layers.append(MixerBlock(mixer, ref, RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)))
        return layers, RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return None  # attention without positional encoding

    @property
    def num_mtp_layers(self) -> int:
        return mtp_layout(self.config, self.mtp_weights).num_layers

    @property
    def num_mtp_kv_layers(self) -> int:
        return mtp_layout(self.config, self.mtp_weights).num_kv_layers

    def build_mtp_head(self, kv_index: int) -> NemotronHMtpHead:
        cfg, dtype = self.config, self.dtype
        return NemotronHMtpHead(
            self, kv_index, mtp_layout(cfg, self.mtp_weights), lambda kind: block_mixer(cfg, kind, dtype)
        )
