"""The skeleton every hybrid decoder-only model shares.

``HybridForCausalLM`` implements the model interface the engine calls:

- ``cls(hf_config, dtype, device)``: builds the layers (on the meta device, then allocated
  uninitialised on ``device``: ``load_weights`` must follow).
- ``cache_spec()``: what the pools must hold (``workers/state_spec.py``), derived from the
  stateful modules themselves, so after TP sharding it describes this rank's shard.
- ``forward(batch, pools) -> [T, hidden]``: final-normed hidden states of every token.
- ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32.
- ``load_weights(iterable of (hf_name, tensor))``: strict; ``mtp.*`` kept in ``mtp_weights``.
- ``num_mtp_layers`` / ``num_mtp_kv_layers`` / ``build_mtp_head(kv_index)``: the checkpoint's
  MTP (NEXTN) drafter (``workers/models/mtp.py``), whose attention blocks keep their KV in
  attention layers ``kv_index .. kv_index + num_mtp_kv_layers - 1`` of the pool (0 layers,
  and a ValueError naming why, for a model without a servable one).
- ``is_vl_checkpoint`` / ``serves_images``: a vision-language checkpoint whose language
  model is served and whose vision tower is not (the HTTP layer refuses image parts).

A family subclass builds its layers (``_build_layers``), registering every stateful module
(attention, recurrent mixer) with the ``StateSites`` it is given: that hands out the
``StateRef`` the layer passes to its mixer, and is all the engine needs to size the pools.
The class attributes name the checkpoint's namespace (``checkpoint_prefix``, the embedding
and final norm) and its scalar multipliers. Every layer is called as ``layer(hidden, ctx)``
with the step's ``LayerContext``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kernels import dense
from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.layers import LayerContext, RMSNorm, RotaryEmbedding
from workers.models.weights import WeightTarget, load_named_weights, module_targets, whole
from workers.state_spec import CacheSpec, StateRef, StateSites

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class HybridDecoderLayer(nn.Module):
    """pre-norm mixer + residual, then pre-norm feed-forward (sum of ``ffns``) + residual.

    Submodule names follow the checkpoint (``linear_attn``/``mamba``/``self_attn``, ``mlp`` or
    ``block_sparse_moe`` + ``shared_mlp`` or ``feed_forward``; the second norm is
    ``post_attention_layernorm`` or, e.g. Bamba's, ``pre_ff_layernorm``). ``ref`` is the
    mixer's state in the pools.
    """

    def __init__(
        self,
        mixer_name: str,
        mixer: nn.Module,
        ref: StateRef,
        ffns: dict[str, nn.Module],
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
        residual_multiplier: float = 1.0,
        post_norm_name: str = "post_attention_layernorm",
    ) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.add_module(post_norm_name, post_attention_layernorm)
        self.add_module(mixer_name, mixer)
        for name, ffn in ffns.items():
            self.add_module(name, ffn)
        self.mixer_name = mixer_name
        self.post_norm_name = post_norm_name
        self.ffn_names = tuple(ffns)
        self.ref = ref
        self.residual_multiplier = residual_multiplier

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        x = getattr(self, self.mixer_name)(x, ctx, self.ref)
        hidden = hidden + self._scaled(x)
        x = getattr(self, self.post_norm_name)(hidden)
        out = getattr(self, self.ffn_names[0])(x)
        for name in self.ffn_names[1:]:
            out = out + getattr(self, name)(x)
        return hidden + self._scaled(out)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """x * residual_multiplier; x itself at 1.0 (the same bits, one pass fewer)."""
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class MixerBlock(nn.Module):
    """``hidden + mixer(norm(hidden))``: one block of Mamba2 / Nemotron-H (checkpoint names
    ``norm``, ``mixer``). ``ref`` is None for stateless mixers (MLP, MoE), which are called
    as ``mixer(x)``. ``residual_in_fp32`` keeps the residual stream in fp32 (the norm reads
    it cast to its own dtype), as Mamba2's ``residual_in_fp32``."""

    def __init__(self, mixer: nn.Module, ref: StateRef | None, norm: RMSNorm, residual_in_fp32: bool = False) -> None:
        super().__init__()
        self.norm = norm
        self.mixer = mixer
        self.ref = ref
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        residual = hidden.float() if self.residual_in_fp32 else hidden
        x = self.norm(hidden.to(self.norm.weight.dtype))
        x = self.mixer(x) if self.ref is None else self.mixer(x, ctx, self.ref)
        return residual + x


class Backbone(nn.Module):
    """HF's ``model.*`` (or ``backbone.*``) namespace: the embedding, ``layers``, the final norm,
    each under the checkpoint's own name (``embed_tokens`` / ``embeddings``, ``norm`` /
    ``norm_f`` / ``final_layernorm``)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        layers: list[nn.Module],
        norm: RMSNorm,
        dtype: torch.dtype,
        embed_name: str = "embed_tokens",
        norm_name: str = "norm",
    ) -> None:
        super().__init__()
        self.add_module(embed_name, nn.Embedding(vocab_size, hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(layers)
        self.add_module(norm_name, norm)
        self._names = (embed_name, norm_name)

    @property
    def embedding(self) -> nn.Embedding:
        return getattr(self, self._names[0])

    @property
    def final_norm(self) -> nn.Module:
        return getattr(self, self._names[1])


class HybridForCausalLM(nn.Module):
    """Base of the model families; see the module docstring for the interface."""

    checkpoint_prefix: str = "model."  # the backbone's namespace in the checkpoint
    embed_name: str = "embed_tokens"
    final_norm_name: str = "norm"
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits / logits_scaling (Granite)
    logits_multiplier: float = 1.0  # logits * logits_multiplier (Falcon-H1)
    is_vl_checkpoint: bool = False  # a vision tower sits beside the language model
    serves_images: bool = False  # no family serves image inputs yet
    ties_embeddings: bool = True  # False: lm_head is its own weight whatever the config says
    batch_invariant: bool = True  # False: no batch-invariant kernels (``deterministic`` is refused)

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        cfg = self.language_config(hf_config)
        self.validate_config(cfg)
        self.config = cfg  # the language model's (a VL checkpoint's text_config)
        self.dtype = dtype
        # a VL checkpoint ties (or not) at its top level, as transformers reads it
        self.tie_word_embeddings = self.ties_embeddings and bool(getattr(hf_config, "tie_word_embeddings", False))
        self._state_sites = StateSites()
        with torch.device("meta"):
            layers, norm = self._build_layers(cfg, dtype, self._state_sites)
            self.model = Backbone(
                cfg.vocab_size, cfg.hidden_size, layers, norm, dtype, self.embed_name, self.final_norm_name
            )
            self.lm_head = (
                None
                if self.tie_word_embeddings
                else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
            )
        self.to_empty(device=torch.device(device))
        self.requires_grad_(False)
        self.rotary: RotaryEmbedding | None = self._build_rotary(cfg)
        self.mtp_weights: dict[str, torch.Tensor] = {}

    # --- family hooks -------------------------------------------------------------------
    @classmethod
    def language_config(cls, hf_config: Any) -> Any:
        """The config of the served language model (a VL family returns ``text_config``)."""
        return hf_config

    @property
    def num_mtp_layers(self) -> int:
        """Layers of the checkpoint's MTP head (the drafter's chain length); 0 = none."""
        return 0

    @property
    def num_mtp_kv_layers(self) -> int:
        """KV pool layers the MTP head's attention needs (default: one per MTP layer)."""
        return self.num_mtp_layers

    def build_mtp_head(self, kv_index: int) -> nn.Module:
        """The MTP drafter over this (loaded) model (``workers/models/mtp.py``)."""
        raise ValueError(f"spec.method 'mtp' needs a checkpoint with an MTP head; {type(self).__name__} has none")

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        """Raise ValueError (naming the field) for config values this implementation cannot serve."""

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], RMSNorm]:
        raise NotImplementedError

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        raise NotImplementedError

    def cache_spec(self) -> CacheSpec:
        return self._state_sites.spec()

    # --- the interface ------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, pools: DevicePools) -> torch.Tensor:
        hidden = self.model.embedding(batch.input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        rope = None
        if self.rotary is not None:
            rope = self.rotary.tables(batch.positions, hidden.dtype)
        ctx = LayerContext(batch, pools, rope, hidden)
        for layer in self.model.layers:
            hidden = layer(hidden, ctx)
        out = self.model.final_norm(hidden)
        return out if out.dtype == self.dtype else out.to(self.dtype)  # fp32 residual streams

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_from(hidden, self.lm_head_weight())

    def lm_head_weight(self) -> torch.Tensor:
        """[V, H]: the lm-head's rows (the tied embedding where there is no lm_head)."""
        return self.model.embedding.weight if self.lm_head is None else self.lm_head.weight

    def logits_from(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """fp32 logits of ``hidden`` against ``weight`` (the lm-head's rows, or some of them:
        ``workers/spec/draft_vocab.py``), with the model's logit scaling."""
        logits = dense.linear(hidden, weight)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.logits_multiplier != 1.0:
            logits = logits * self.logits_multiplier
        return logits.float()

    def weight_targets(self) -> dict[str, WeightTarget]:
        targets = module_targets(self.model, self.checkpoint_prefix)
        if self.lm_head is None:
            targets["lm_head.weight"] = whole(self.model.embedding.weight, required=False)
        else:
            targets["lm_head.weight"] = whole(self.lm_head.weight)
        return targets

    def checkpoint_name(self, name: str) -> str:
        """Hook: a tensor's name in this model's layout (older checkpoints renamed some)."""
        return name

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Hook: checkpoint ``(name, tensor)`` -> those ``weight_targets`` names (renamed by
        ``checkpoint_name``; a family may also skip or split tensors here)."""
        return ((self.checkpoint_name(name), t) for name, t in weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.mtp_weights = load_named_weights(self.weight_targets(), self.checkpoint_tensors(weights))


def check_hybrid_layer_types(cfg: Any) -> list[str]:
    """Qwen3-Next / Granite style configs: silu, ``layer_types`` of linear / full attention."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
    layer_types = list(cfg.layer_types)
    if len(layer_types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries, num_hidden_layers={cfg.num_hidden_layers}")
    unknown = sorted(set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown}; expected {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}")
    return layer_types


def default_rope(cfg: Any, head_dim: int, partial_factor: float | None = None) -> RotaryEmbedding:
    """Plain RoPE from ``cfg.rope_parameters``; scaled variants are rejected."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported (only 'default')")
    factor = partial_factor if partial_factor is not None else params.get("partial_rotary_factor", 1.0)
    return RotaryEmbedding(int(head_dim * factor), float(params.get("rope_theta", 10000.0)))
