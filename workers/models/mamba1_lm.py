"""Mamba (``MambaForCausalLM``) and FalconMamba (``FalconMambaForCausalLM``): pure stacks of
Mamba1 blocks, no attention.

Block i is ``hidden + mixer(norm(hidden))`` (``backbone.layers.{i}.norm`` / ``.mixer``), the
mixer the Mamba1 selective-scan mixer of ``workers/models/mamba1.py`` (``expand * hidden_size``
channels, ``time_step_rank`` dt rank); FalconMamba RMS-normalises dt, B and C inside the mixer
with weightless norms (``mixer_rms_eps``). Then ``backbone.norm_f`` and ``lm_head`` (or the
tied ``backbone.embeddings``). With ``residual_in_fp32`` the residual stream is kept in fp32.
The model keeps no paged state: its pools are Mamba slots only, with page ids as the radix
tree's keys (as Mamba2's).

Config fields read: ``hidden_size``, ``num_hidden_layers``, ``state_size``, ``expand``,
``conv_kernel``, ``use_conv_bias``, ``use_bias`` (in / out projections), ``time_step_rank``
(``"auto"`` is resolved by the config), ``hidden_act`` (the conv's activation: only silu; the
gate is always SiLU), ``layer_norm_epsilon``, ``residual_in_fp32``, ``tie_word_embeddings``,
``mixer_rms_eps`` (FalconMamba). Not math: ``time_step_scale`` / ``min`` / ``max`` /
``init_scheme`` / ``floor``, ``initializer_range``, ``rescale_prenorm_residual`` (init only),
``use_mambapy``, ``use_associative_scan`` (torch scan choices of transformers).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.models.base import HybridForCausalLM, MixerBlock
from workers.models.layers import RMSNorm, RotaryEmbedding
from workers.models.mamba1 import Mamba1Dims, Mamba1Mixer
from workers.state_spec import StateSites


class MambaForCausalLM(HybridForCausalLM):
    checkpoint_prefix = "backbone."
    embed_name = "embeddings"
    final_norm_name = "norm_f"

    @classmethod
    def mixer_norm_eps(cls, cfg: Any) -> float | None:
        return None  # plain Mamba: no norms on dt, B, C

    @classmethod
    def mamba_dims(cls, cfg: Any) -> Mamba1Dims:
        return Mamba1Dims(
            hidden_size=cfg.hidden_size,
            d_inner=int(cfg.expand * cfg.hidden_size),
            state_size=cfg.state_size,
            dt_rank=int(cfg.time_step_rank),
            conv_kernel=cfg.conv_kernel,
            conv_bias=bool(cfg.use_conv_bias),
            proj_bias=bool(cfg.use_bias),
            inner_norm_eps=cls.mixer_norm_eps(cfg),
            inner_norm_weighted=False,
        )

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported (the Mamba conv activation; only 'silu')")
        cls.mamba_dims(cfg).validate()

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[MixerBlock], RMSNorm]:
        layers = []
        for _ in range(cfg.num_hidden_layers):
            mixer = Mamba1Mixer(self.mamba_dims(cfg), dtype)
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


class FalconMambaForCausalLM(MambaForCausalLM):
    @classmethod
    def mixer_norm_eps(cls, cfg: Any) -> float | None:
        return float(cfg.mixer_rms_eps)
