"""Nemotron-H's MTP head (``num_nextn_predict_layers``, ``mtp_layers_block_type``), from ``mtp.*``.

Layout, as released (Nemotron 3 Super: one MTP layer of pattern ``*E``, attention then MoE)
and as vLLM's / SGLang's Nemotron-H MTP loaders and Megatron-Bridge's exporter name it: MTP
layer m < ``num_nextn_predict_layers`` is L = ``len(mtp_layers_block_type)`` blocks stored
flat, block b of layer m under ``mtp.layers.{m * L + b}.``. Each block is a backbone block of
kind ``mtp_layers_block_type[b]`` with the backbone's names (``norm``, ``mixer.*``); the first
block of every MTP layer also holds the fusion, ``enorm`` / ``hnorm`` [H] and ``eh_proj``
[H, 2H], and the last one ``final_layernorm`` [H]. The embeddings and ``lm_head`` are the
target's (``backbone.embeddings``, ``lm_head``).

Row s of MTP layer m takes a hidden state h and the next token x_{s+1}, and predicts x_{s+2}:

    x = eh_proj([enorm(embed(x_{s+1})), hnorm(h)])
    x = x + mixer_b(norm_b(x))                   for the blocks b of layer m, in order
    h'_m(s) = final_layernorm(x)

with h = the target's final-normed h_s for layer 0 and h'_{m-1}(s - 1) for m > 0 (the
drafter's chain, ``workers/models/mtp.py``). Norms are plain RMSNorms (``layer_norm_epsilon``);
attention has no positional encoding, as the backbone's.

State: every attention block keeps its own KV in pool layer ``kv_index + a`` (a = attention
blocks before it, over all MTP layers), at the target's page locations; MoE and MLP blocks
keep none. A Mamba2 block (``linear_attention``) would need recurrent state per catch-up
row and per draft: it is refused with the value named.

Config: ``num_nextn_predict_layers`` and ``mtp_layers_block_type`` (or the legacy
``mtp_hybrid_override_pattern``, which transformers converts) are read; the blocks read the
backbone's fields (heads, ``layer_norm_epsilon``, every MoE field, ``moe_latent_size``).
Refused: ``mtp.layers.*`` that are not exactly ``num_nextn_predict_layers * L`` blocks (so
a repeated-layer export holding one MTP layer for several is not guessed at) and
``mtp_block_configs`` (per-block MoE sizes of the puzzle variant). ``keep_mtp_spec_in_bf16``
is a precision choice of quantized exports, not math.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workers.models.base import FULL_ATTENTION, LINEAR_ATTENTION, MixerBlock
from workers.models.layers import LayerContext, RMSNorm, linear
from workers.models.mtp import MtpHeadBase, mtp_layer_ids
from workers.state_spec import ATTENTION, StateRef

MixerFactory = Callable[[str], nn.Module]  # block kind -> the backbone's mixer of that kind


@dataclass(frozen=True)
class MtpLayout:
    """The head's shape from the config: ``num_layers`` MTP layers of ``block_types`` each."""

    num_layers: int
    block_types: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        return self.num_layers * len(self.block_types)

    @property
    def num_kv_layers(self) -> int:
        return self.num_layers * self.block_types.count(FULL_ATTENTION)


def mtp_layout(cfg: Any, weights: Mapping[str, torch.Tensor]) -> MtpLayout:
    """The config's MTP head; ``num_layers`` is 0 when the checkpoint has no ``mtp.*`` tensors."""
    n = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"num_nextn_predict_layers={n!r} must be a non-negative integer")
    kinds = tuple(getattr(cfg, "mtp_layers_block_type", None) or ())
    return MtpLayout(n if weights else 0, kinds)


def check_layout(layout: MtpLayout, weights: Mapping[str, torch.Tensor], cfg: Any, target_kv_layers: int) -> None:
    """Raise ValueError (naming the field and values) for a head this module cannot build."""
    n, kinds = layout.num_layers, list(layout.block_types)
    if n < 1:
        raise ValueError(f"num_nextn_predict_layers={n}: spec.method 'mtp' needs at least one MTP layer")
    if not kinds:
        raise ValueError("mtp_layers_block_type is empty: an MTP layer needs at least one block")
    if LINEAR_ATTENTION in kinds:
        raise ValueError(
            f"mtp_layers_block_type={kinds} has a Mamba2 block ('linear_attention'): "
            "its recurrent state per draft is not served"
        )
    if getattr(cfg, "mtp_block_configs", None):
        raise ValueError("mtp_block_configs (per-block MoE sizes of the MTP layers) is not supported")
    found = mtp_layer_ids(weights)
    if found != list(range(layout.num_blocks)):
        raise ValueError(
            f"num_nextn_predict_layers={n} with mtp_layers_block_type={kinds} means "
            f"blocks mtp.layers.0..{layout.num_blocks - 1}, but the checkpoint's mtp.* "
            f"tensors hold blocks {found}"
        )
    if layout.num_kv_layers and not target_kv_layers:
        raise ValueError(
            f"mtp_layers_block_type={kinds} has attention blocks, but the model has "
            "no attention layer, so there is no KV pool for them"
        )


class MtpBlock(MixerBlock):
    """``mtp.layers.{i}``: a backbone block (``norm``, ``mixer``), plus the MTP layer's fusion
    (``enorm``, ``hnorm``, ``eh_proj``) on its first block and ``final_layernorm`` on its last."""

    def __init__(
        self,
        mixer: nn.Module,
        ref: StateRef | None,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        first: bool,
        last: bool,
    ) -> None:
        super().__init__(mixer, ref, RMSNorm(hidden_size, eps, dtype))
        if first:
            self.enorm = RMSNorm(hidden_size, eps, dtype)
            self.hnorm = RMSNorm(hidden_size, eps, dtype)
            self.eh_proj = linear(2 * hidden_size, hidden_size, False, dtype)
        if last:
            self.final_layernorm = RMSNorm(hidden_size, eps, dtype)


class NemotronHMtpHead(MtpHeadBase):
    """See the module docstring; ``build_mixer(kind)`` makes the backbone's mixer of a kind."""

    def __init__(self, target: nn.Module, kv_index: int, layout: MtpLayout, build_mixer: MixerFactory) -> None:
        super().__init__(target, kv_index, layout.num_layers)
        cfg, dtype = target.config, target.dtype
        check_layout(layout, target.mtp_weights, cfg, target.cache_spec().num_layers(ATTENTION))
        per_layer = len(layout.block_types)
        blocks: list[MtpBlock] = []
        next_kv = kv_index
        with torch.device("meta"):
            for i in range(layout.num_blocks):
                b = i % per_layer
                kind = layout.block_types[b]
                ref = None
                if kind == FULL_ATTENTION:
                    ref, next_kv = StateRef(ATTENTION, next_kv), next_kv + 1
                blocks.append(
                    MtpBlock(
                        build_mixer(kind),
                        ref,
                        cfg.hidden_size,
                        cfg.layer_norm_epsilon,
                        dtype,
                        first=b == 0,
                        last=b == per_layer - 1,
                    )
                )
            self.layers = nn.ModuleList(blocks)
        self.blocks_per_layer = per_layer
        self._materialize()

    def predict(self, layer: int, emb: torch.Tensor, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        start = layer * self.blocks_per_layer
        blocks = [self.layers[i] for i in range(start, start + self.blocks_per_layer)]
        first, last = blocks[0], blocks[-1]
        x = first.eh_proj(torch.cat([first.enorm(emb), first.hnorm(hidden)], dim=-1))
        for block in blocks:
            x = block(x, ctx)
        return last.final_layernorm(x)
