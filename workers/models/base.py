"""The skeleton every hybrid decoder-only model shares.

``HybridForCausalLM`` implements the model interface the engine calls:

- ``cls(hf_config, dtype, device)``: builds the layers (on the meta device, then allocated
  uninitialised on ``device``: ``load_weights`` must follow).
- ``cache_spec()``: what the pools must hold.
- ``forward(batch, pools) -> [T, hidden]``: final-normed hidden states of every token.
- ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32.
- ``load_weights(iterable of (hf_name, tensor))``: strict; ``mtp.*`` kept in ``mtp_weights``.

Attention layers are numbered 0..num_attn_layers-1 in layer order and index ``pools.kv``;
recurrent layers likewise index ``pools.mamba``. A family subclass only builds its layers
(``_build_layers``) and states its dims.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from workers.device_pools import CacheSpec, DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.layers import RMSNorm, RopeTables, RotaryEmbedding
from workers.models.weights import WeightTarget, load_named_weights, module_targets, whole

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class HybridDecoderLayer(nn.Module):
    """pre-norm mixer + residual, then pre-norm feed-forward (sum of ``ffn_names``) + residual.

    Submodule names follow the checkpoint (``linear_attn``/``mamba``/``self_attn``, ``mlp`` or
    ``block_sparse_moe`` + ``shared_mlp``). ``state_idx`` is the layer's index into the KV
    pool (attention) or the Mamba pool (recurrent).
    """

    def __init__(self, mixer_name: str, mixer: nn.Module, is_attention: bool, state_idx: int,
                 ffns: dict[str, nn.Module], input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm, residual_multiplier: float = 1.0) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.add_module(mixer_name, mixer)
        for name, ffn in ffns.items():
            self.add_module(name, ffn)
        self.mixer_name = mixer_name
        self.ffn_names = tuple(ffns)
        self.is_attention = is_attention
        self.state_idx = state_idx
        self.residual_multiplier = residual_multiplier

    def forward(self, hidden: torch.Tensor, rope: RopeTables | None, batch: ForwardBatch,
                pools: DevicePools) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        mixer = getattr(self, self.mixer_name)
        if self.is_attention:
            x = mixer(x, rope, batch, pools, self.state_idx)
        else:
            x = mixer(x, batch, pools, self.state_idx)
        hidden = hidden + x * self.residual_multiplier
        x = self.post_attention_layernorm(hidden)
        out = getattr(self, self.ffn_names[0])(x)
        for name in self.ffn_names[1:]:
            out = out + getattr(self, name)(x)
        return hidden + out * self.residual_multiplier


class Backbone(nn.Module):
    """HF's ``model.*`` namespace: ``embed_tokens``, ``layers``, ``norm``."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[HybridDecoderLayer],
                 norm: RMSNorm, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class HybridForCausalLM(nn.Module):
    """Base of the model families; see the module docstring for the interface."""

    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.validate_config(hf_config)
        self.config = hf_config
        self.dtype = dtype
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        with torch.device("meta"):
            layers, norm = self._build_layers(hf_config, dtype)
            self.model = Backbone(hf_config.vocab_size, hf_config.hidden_size, layers, norm, dtype)
            self.lm_head = (None if self.tie_word_embeddings else
                            nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False,
                                      dtype=dtype))
        self.to_empty(device=torch.device(device))
        self.requires_grad_(False)
        self.rotary: RotaryEmbedding | None = self._build_rotary(hf_config)
        self.mtp_weights: dict[str, torch.Tensor] = {}

    # --- family hooks -------------------------------------------------------------------
    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        """Raise ValueError for config values this implementation cannot serve."""
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
        layer_types = list(cfg.layer_types)
        if len(layer_types) != cfg.num_hidden_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries, "
                             f"num_hidden_layers={cfg.num_hidden_layers}")
        unknown = sorted(set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            raise ValueError(f"unsupported layer types {unknown}; expected "
                             f"{LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}")

    def _build_layers(self, cfg: Any, dtype: torch.dtype) -> tuple[list[HybridDecoderLayer], RMSNorm]:
        raise NotImplementedError

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        raise NotImplementedError

    def cache_spec(self) -> CacheSpec:
        raise NotImplementedError

    # --- the interface ------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, pools: DevicePools) -> torch.Tensor:
        hidden = self.model.embed_tokens(batch.input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        rope = None
        if self.rotary is not None:
            rope = self.rotary.tables(batch.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, rope, batch, pools)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.nn.functional.linear(hidden, weight)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits.float()

    def weight_targets(self) -> dict[str, WeightTarget]:
        targets = module_targets(self.model, "model.")
        if self.lm_head is None:
            targets["lm_head.weight"] = whole(self.model.embed_tokens.weight, required=False)
        else:
            targets["lm_head.weight"] = whole(self.lm_head.weight)
        return targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.mtp_weights = load_named_weights(self.weight_targets(), weights)

    # --- helpers for subclasses ---------------------------------------------------------
    def layer_counts(self) -> tuple[int, int]:
        """(num attention layers, num recurrent layers)."""
        kinds = [layer.is_attention for layer in self.model.layers]
        return sum(kinds), len(kinds) - sum(kinds)


def state_indices(layer_types: list[str]) -> list[int]:
    """Per layer, its index among the layers of its own kind (KV pool or Mamba pool)."""
    seen = {LINEAR_ATTENTION: 0, FULL_ATTENTION: 0}
    out = []
    for kind in layer_types:
        out.append(seen[kind])
        seen[kind] += 1
    return out


def default_rope(cfg: Any, head_dim: int, partial_factor: float | None = None) -> RotaryEmbedding:
    """Plain RoPE from ``cfg.rope_parameters``; scaled variants are rejected."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default')")
    factor = partial_factor if partial_factor is not None else params.get("partial_rotary_factor", 1.0)
    return RotaryEmbedding(int(head_dim * factor), float(params.get("rope_theta", 10000.0)))
