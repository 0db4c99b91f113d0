"""Mamba2 (``Mamba2ForCausalLM``): a pure stack of Mamba2 blocks, no attention.

Block i is ``hidden + mixer(norm(hidden))`` (``backbone.layers.{i}.norm`` / ``.mixer``), the
mixer the shared Mamba2 SSD mixer with its gated RMSNorm gating before the norm; then
``backbone.norm_f`` and ``lm_head`` (or the tied ``backbone.embeddings``). With
``residual_in_fp32`` the residual stream is kept in fp32. The model keeps no paged state:
its pools are Mamba slots only, with page ids as the radix tree's keys.

Config fields read: ``num_heads``, ``head_dim``, ``state_size``, ``n_groups``, ``expand``
(checked against heads x head_dim), ``conv_kernel``, ``use_conv_bias``, ``use_bias``
(in/out projections), ``hidden_act`` (the conv's activation: only silu), ``chunk_size``,
``time_step_limit`` (dt clamp), ``layer_norm_epsilon``, ``residual_in_fp32``,
``tie_word_embeddings``. Not math: ``time_step_rank`` (unused by the mixer), ``time_step_min``
/ ``max`` / ``floor``, ``initializer_range``, ``rescale_prenorm_residual`` (init only).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.models.base import HybridForCausalLM, MixerBlock
from workers.models.layers import RMSNorm, RotaryEmbedding
from workers.models.mamba2 import Mamba2Dims, Mamba2Mixer
from workers.models.mamba2_config import check_mamba_dims, time_step_limit
from workers.state_spec import StateSites


def mamba_dims(cfg: Any) -> Mamba2Dims:
    return Mamba2Dims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        state_size=cfg.state_size,
        num_groups=cfg.n_groups,
        conv_kernel=cfg.conv_kernel,
        conv_bias=bool(cfg.use_conv_bias),
        proj_bias=bool(cfg.use_bias),
        chunk_size=cfg.chunk_size,
        dt_limit=time_step_limit(cfg),
        eps=cfg.layer_norm_epsilon,
    )


class Mamba2ForCausalLM(HybridForCausalLM):
    checkpoint_prefix = "backbone."
    embed_name = "embeddings"
    final_norm_name = "norm_f"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_mamba_dims(cfg, mamba_dims(cfg), int(cfg.expand * cfg.hidden_size), "expand * hidden_size")

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[MixerBlock], RMSNorm]:
        layers = []
        for _ in range(cfg.num_hidden_layers):
            mixer = Mamba2Mixer(mamba_dims(cfg), dtype)
            layers.append(
                MixerBlock(
                    mixer,
                    sites.add(mixer),
                    RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype),
                    residual_in_fp32=bool(cfg.residual_in_fp32),
                )
            )
        return layers, RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return None

    def checkpoint_name(self, name: str) -> str:
        # The original state-spaces checkpoints call the embedding ``embedding`` (as
        # transformers' own load hook renames it).
        return name.replace("backbone.embedding.", "backbone.embeddings.", 1)
