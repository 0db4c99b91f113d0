"""Zamba (``ZambaForCausalLM``, Zamba-7B-v1): multi-head Mamba1 layers and one shared
attention block.

``layers_block_type[i]`` is ``linear_attention`` (``h + mamba(input_layernorm(h))``) or
``hybrid``: the shared transformer block ``t = shared_transf(h)``, ``t = linear(t)``, then
the Mamba layer on ``h + t``: ``h + mamba(input_layernorm(h + t))``
(``layers.{i}.shared_transf`` / ``linear`` / ``mamba_decoder``). The block reads
``cat(h, embeddings)`` (``attention_hidden_size`` = 2H): ``input_layernorm`` (2H), attention
with ``attention_head_dim`` heads (default 2H / heads), softmax scale (head_dim / 2)^-1/2, no
positional encoding, no bias, ``o_proj`` out to H; ``pre_ff_layernorm`` and a
``gate_proj`` / ``up_proj`` / ``down_proj`` MLP with ``hidden_act``, no residual inside the
block. Unlike Zamba2 there is one block, no LoRA adapters, no RoPE, and the MLP is unfused.

Every hybrid layer is one invocation of the block with its own KV (its own attention
``StateRef``). As in transformers the block is shared only when ``tie_word_embeddings`` is set
(its tie mapping covers it): its weights are then required under the first hybrid layer and
accepted, not needed, under the others; untied, each hybrid layer runs its own copy.

The Mamba mixer is ``workers/models/mamba1_heads.py`` (``n_mamba_heads`` independent Mamba1
heads; ``in_proj``'s interleaved x / z rows are de-interleaved at load).

Config fields read: ``hidden_size``, ``layers_block_type`` (``attn_layer_period`` /
``attn_layer_offset`` only through it), ``num_attention_heads``, ``num_key_value_heads``,
``attention_head_dim``, ``attention_hidden_size`` (must be 2 * hidden_size: the block's input
is that concatenation), ``intermediate_size``, ``hidden_act`` (the MLP's), ``rms_norm_eps``,
``n_mamba_heads``, ``mamba_d_state``, ``mamba_d_conv``, ``mamba_expand``, ``mamba_dt_rank``,
``mamba_conv_bias``, ``mamba_proj_bias``, ``tie_word_embeddings``. Refused:
``hidden_mamba_act`` other than silu (the conv's activation). Not math: ``use_mamba_kernels``,
``use_associative_scan``, ``num_logits_to_keep``, ``attention_dropout``, ``time_step_*`` and
``initializer_range`` (init only), ``max_position_embeddings`` (no positions).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from workers.models.base import LINEAR_ATTENTION, HybridForCausalLM
from workers.models.layers import Attention, AttentionDims, DenseMLP, LayerContext, RMSNorm, RotaryEmbedding, linear
from workers.models.mamba1_heads import Mamba1HeadsDims, Mamba1HeadsMixer, deinterleave_in_proj
from workers.models.weights import WeightTarget, shared_child_targets
from workers.state_spec import StateRef, StateSites

HYBRID = "hybrid"


def mamba_dims(cfg: Any) -> Mamba1HeadsDims:
    return Mamba1HeadsDims(
        hidden_size=cfg.hidden_size,
        d_inner=cfg.mamba_expand * cfg.hidden_size,
        num_heads=cfg.n_mamba_heads,
        state_size=cfg.mamba_d_state,
        dt_rank=int(cfg.mamba_dt_rank),
        conv_kernel=cfg.mamba_d_conv,
        conv_bias=bool(cfg.mamba_conv_bias),
        proj_bias=bool(cfg.mamba_proj_bias),
    )


class ZambaMambaLayer(nn.Module):
    """``h + mamba(input_layernorm(h + extra))`` (``extra``: the shared block's output)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> None:
        super().__init__()
        self.mamba = Mamba1HeadsMixer(mamba_dims(cfg), dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.ref: StateRef = sites.add(self.mamba)

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, extra: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden if extra is None else hidden + extra
        return hidden + self.mamba(self.input_layernorm(x), ctx, self.ref)


class ZambaSharedBlock(nn.Module):
    """The shared transformer block; ``forward(h, ctx, ref)`` with ``ref`` the invocation's KV."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        width, hd = cfg.attention_hidden_size, cfg.attention_head_dim
        self.input_layernorm = RMSNorm(width, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(
            AttentionDims(
                hidden_size=width,
                num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=hd,
                bias=False,
                scale=(hd / 2) ** -0.5,
                output_size=cfg.hidden_size,
            ),
            dtype,
        )
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.feed_forward = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, act=cfg.hidden_act)

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        assert ctx.embeddings is not None
        x = self.input_layernorm(torch.cat([hidden, ctx.embeddings], dim=-1))
        x = self.self_attn(x, ctx, ref)
        return self.feed_forward(self.pre_ff_layernorm(x))


class ZambaHybridLayer(nn.Module):
    """shared block -> ``linear`` -> the Mamba layer; the block is a child of every hybrid
    layer that uses it (one module, one set of weights), required under its first user only."""

    def __init__(
        self, block: ZambaSharedBlock, first_use: bool, cfg: Any, dtype: torch.dtype, sites: StateSites
    ) -> None:
        super().__init__()
        self.shared_transf = block
        self.attn_ref: StateRef = sites.add(block.self_attn)  # this invocation's own KV
        self.linear = linear(cfg.hidden_size, cfg.hidden_size, False, dtype)
        self.mamba_decoder = ZambaMambaLayer(cfg, dtype, sites)
        self.first_use = first_use

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        t = self.shared_transf(hidden, ctx, self.attn_ref)
        return self.mamba_decoder(hidden, ctx, extra=self.linear(t))

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return shared_child_targets(self, prefix, "shared_transf", self.first_use)


class ZambaForCausalLM(HybridForCausalLM):
    final_norm_name = "final_layernorm"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        kinds = list(cfg.layers_block_type)
        unknown = sorted(set(kinds) - {LINEAR_ATTENTION, HYBRID})
        if unknown:
            raise ValueError(f"layers_block_type has unsupported entries {unknown}")
        if len(kinds) != cfg.num_hidden_layers:
            raise ValueError(f"layers_block_type has {len(kinds)} entries, num_hidden_layers={cfg.num_hidden_layers}")
        if cfg.hidden_mamba_act != "silu":
            raise ValueError(f"hidden_mamba_act={cfg.hidden_mamba_act!r} is not supported (the conv's; only 'silu')")
        if HYBRID in kinds and cfg.attention_hidden_size != 2 * cfg.hidden_size:
            raise ValueError(
                f"attention_hidden_size={cfg.attention_hidden_size} is not supported: the shared block reads "
                f"cat(hidden, embeddings), 2 * hidden_size={2 * cfg.hidden_size} wide"
            )
        mamba_dims(cfg).validate()

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], RMSNorm]:
        shared = bool(getattr(cfg, "tie_word_embeddings", False))  # see the module docstring
        block = ZambaSharedBlock(cfg, dtype) if shared and HYBRID in cfg.layers_block_type else None
        layers: list[nn.Module] = []
        for kind in cfg.layers_block_type:
            if kind == LINEAR_ATTENTION:
                layers.append(ZambaMambaLayer(cfg, dtype, sites))
            elif block is not None:
                first_use = not any(isinstance(layer, ZambaHybridLayer) for layer in layers)
                layers.append(ZambaHybridLayer(block, first_use, cfg, dtype, sites))
            else:
                layers.append(ZambaHybridLayer(ZambaSharedBlock(cfg, dtype), True, cfg, dtype, sites))
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return None  # the shared attention has no positional encoding

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The Mamba ``in_proj`` rows come interleaved (x, z per channel): de-interleaved here."""
        for name, t in super().checkpoint_tensors(weights):
            if name.endswith((".mamba.in_proj.weight", ".mamba.in_proj.bias")):
                t = deinterleave_in_proj(t)
            yield name, t
