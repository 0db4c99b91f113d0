"""Lfm3 (``Lfm3ForCausalLM``, the text model): LFM2's gated short convolutions with two
kinds of attention layer, ``full_attention`` and ``sliding_attention``.

Layer i (``layer_types[i]``): ``operator_norm`` -> ``conv`` (the gated short conv of
``conv_L_cache`` taps) or ``self_attn`` -> ``post_operator_norm`` (``use_sandwich_norm``) +
residual; ``ffn_norm`` -> SwiGLU ``feed_forward`` (``intermediate_size`` as is) ->
``post_ffn_norm`` + residual. Attention (Qwen3-style names ``q_proj`` .. ``o_proj``, bias
``attention_bias``): plain per-head ``q_norm`` / ``k_norm``, RoPE computed and applied in fp32,
then q and k back in the model dtype; ``sliding_attention`` layers see the last
``sliding_window`` positions only (the paged KV keeps every token: simplest and correct, the
pages before the window are just not read); ``use_attention_gate`` scales each head's
output by ``sigmoid(g_proj(x))`` (``self_attn.gate_proj`` in checkpoints). Each attention
type has its own RoPE from ``rope_parameters[type]``: ``default`` (every head dim rotated at
``rope_theta``) or ``proportional`` (the first ``int(partial_rotary_factor * head_dim // 2)``
frequencies of the full-head spectrum kept, the rest zero, all divided by ``factor``).

Config fields read: ``layer_types``, ``sliding_window``, ``rope_parameters`` (per type),
``head_dim``, ``attention_bias``, ``use_attention_gate``, ``use_sandwich_norm``,
``conv_L_cache``, ``conv_bias``, ``norm_eps``, ``intermediate_size``, ``tie_word_embeddings``.
Refused: other rope types, and ``partial_rotary_factor`` / ``factor`` on a ``default`` entry
(transformers' Lfm3 ignores them there). Not math: ``attention_dropout``,
``max_position_embeddings``, init fields. The vision-language ``Lfm3VlForConditionalGeneration``
is served for its text part (``workers/models/wrapped_text.py``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from workers.models.base import FULL_ATTENTION, HybridForCausalLM
from workers.models.layers import Attention, DenseMLP, RMSNorm, RotaryEmbedding
from workers.models.lfm2 import (
    CONV,
    MLP_RENAMES,
    LfmDecoderLayer,
    check_layer_types,
    lfm2_attention_dims,
    rename,
    short_conv,
)
from workers.models.mamba2_config import head_dim
from workers.state_spec import StateSites

SLIDING_ATTENTION = "sliding_attention"
ROPE_TYPES = ("default", "proportional")
# released checkpoints (and transformers' save_pretrained) name the head gate gate_proj
RENAMES = MLP_RENAMES + ((re.compile(r"\.self_attn\.gate_proj\."), ".self_attn.g_proj."),)


class ProportionalRotary(RotaryEmbedding):
    """transformers' ``proportional`` RoPE: the rotate-half layout over the whole head, the
    default spectrum ``theta^(-2i / head_dim)`` for the first ``num_rotated`` frequencies and
    zero (no rotation) for the rest, everything divided by ``factor``."""

    def __init__(self, head_dim: int, theta: float, num_rotated: int, factor: float) -> None:
        super().__init__(head_dim, theta)
        self.num_rotated, self.factor = num_rotated, factor

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        freqs = super().inv_freq(device)
        freqs[self.num_rotated :] = 0.0
        return freqs / self.factor


def layer_rotary(cfg: Any, layer_type: str) -> RotaryEmbedding:
    """The RoPE of one attention layer type (``rope_parameters[layer_type]``)."""
    params = dict((cfg.rope_parameters or {}).get(layer_type) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_parameters[{layer_type!r}].rope_type={rope_type!r} is not supported; expected one of {ROPE_TYPES}"
        )
    if "rope_theta" not in params:
        raise ValueError(f"rope_parameters[{layer_type!r}] has no rope_theta")
    hd, theta = head_dim(cfg), float(params["rope_theta"])
    partial, factor = params.get("partial_rotary_factor"), params.get("factor")
    if rope_type == "default":
        for name, value in (("partial_rotary_factor", partial), ("factor", factor)):
            if value is not None and float(value) != 1.0:
                raise ValueError(
                    f"rope_parameters[{layer_type!r}].{name}={value} is not "
                    "supported with rope_type 'default' (transformers' Lfm3 "
                    "ignores it; only 1.0 is served)"
                )
        return RotaryEmbedding(hd, theta)
    num_rotated = int(float(1.0 if partial is None else partial) * hd // 2)
    return ProportionalRotary(hd, theta, num_rotated, float(1.0 if factor is None else factor))


class Lfm3ForCausalLM(HybridForCausalLM):
    final_norm_name = "embedding_norm"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        kinds = check_layer_types(cfg, (CONV, FULL_ATTENTION, SLIDING_ATTENTION))
        if SLIDING_ATTENTION in kinds and (cfg.sliding_window is None or cfg.sliding_window < 1):
            raise ValueError(f"sliding_window={cfg.sliding_window!r}: sliding_attention layers need a positive window")
        for layer_type in sorted(set(kinds) - {CONV}):
            layer_rotary(cfg, layer_type)

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[LfmDecoderLayer], RMSNorm]:
        layers = []
        for kind in cfg.layer_types:
            mixer: nn.Module
            rotary = None
            if kind == CONV:
                name, mixer = CONV, short_conv(cfg, dtype)
            else:
                window = cfg.sliding_window if kind == SLIDING_ATTENTION else None
                dims = lfm2_attention_dims(
                    cfg, bool(cfg.attention_bias), head_gate=bool(cfg.use_attention_gate), sliding_window=window
                )
                name, mixer, rotary = "self_attn", Attention(dims, dtype), layer_rotary(cfg, kind)
            ffn = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)
            layers.append(
                LfmDecoderLayer(
                    name,
                    mixer,
                    sites.add(mixer),
                    ffn,
                    cfg.hidden_size,
                    cfg.norm_eps,
                    dtype,
                    sandwich=bool(cfg.use_sandwich_norm),
                    rotary=rotary,
                )
            )
        return layers, RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return None  # each attention layer holds the RoPE of its type

    def checkpoint_name(self, name: str) -> str:
        return rename(name, RENAMES)
