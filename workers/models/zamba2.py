"""Zamba2 (``Zamba2ForCausalLM``): Mamba2 layers and shared attention blocks with LoRA adapters.

``layers_block_type[i]`` is ``linear_attention`` (``h + mamba(input_layernorm(h))``) or
``hybrid``: a shared transformer block ``t = block(h)`` (block ``j % num_mem_blocks`` at the
j-th hybrid layer), ``t = linear(t)``, then the Mamba2 layer on ``h + t``:
``h + mamba(input_layernorm(h + t))``. The shared block reads ``cat(h, embeddings)`` (2H):
``input_layernorm`` (2H), attention with head dim 2H / heads, softmax scale
(head_dim / 2)^-1/2, optional RoPE (``use_mem_rope``), no bias, out to H; ``pre_ff_layernorm``
and a fused ``gate_up_proj`` MLP with ``hidden_act``, no residual inside the block.

Each invocation j of a block has its own KV (its own attention ``StateRef``) and, where the
block owns it, its own LoRA adapters on q, k, v (``use_shared_attention_adapter``) and on the
MLP's ``[gate | up]``. The checkpoint stores a block's weights under its first hybrid layer
(``layers.{i}.shared_transformer.*``); later layers that reuse it may repeat them. As in
transformers, the blocks are shared only when ``tie_word_embeddings`` is set (its tie mapping
covers them): untied, every hybrid layer runs its own copy of its block, each copy required.

The Mamba2 mixer: ``n_mamba_heads`` heads of ``mamba_headdim``, conv bias always on (as in
transformers, whatever ``use_conv_bias`` says), projection bias ``add_bias_linear``, gated
norm eps 1e-5, dt clamped below at ``time_step_min`` (transformers 5.24 and 5.25 alike; it
reads no ``time_step_limit`` for Zamba2). Not math: ``use_mem_eff_path``,
``use_mamba_kernels``, init fields; ``use_long_context`` only sets ``max_position_embeddings``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.models.base import LINEAR_ATTENTION, HybridForCausalLM, default_rope
from workers.models.layers import Attention, AttentionDims, DenseMLP, LayerContext, RMSNorm, RotaryEmbedding, linear
from workers.models.mamba2 import Mamba2Dims, Mamba2Mixer
from workers.models.mamba2_config import check_mamba_dims
from workers.models.weights import WeightTarget, shared_child_targets
from workers.state_spec import StateRef, StateSites

HYBRID = "hybrid"


def mamba_dims(cfg: Any) -> Mamba2Dims:
    return Mamba2Dims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.n_mamba_heads,
        head_dim=cfg.mamba_headdim,
        state_size=cfg.mamba_d_state,
        num_groups=cfg.mamba_ngroups,
        conv_kernel=cfg.mamba_d_conv,
        conv_bias=True,
        proj_bias=bool(cfg.add_bias_linear),
        chunk_size=cfg.chunk_size,
        dt_limit=(float(cfg.time_step_min), float("inf")),
        eps=1e-5,
    )


class Zamba2MambaLayer(nn.Module):
    """``h + mamba(input_layernorm(h + extra))`` (``extra``: the shared block's output)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> None:
        super().__init__()
        self.mamba = Mamba2Mixer(mamba_dims(cfg), dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.ref: StateRef = sites.add(self.mamba)

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, extra: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden if extra is None else hidden + extra
        return hidden + self.mamba(self.input_layernorm(x), ctx, self.ref)


class Zamba2SharedBlock(nn.Module):
    """One shared transformer block; ``forward(h, ctx, ref, invocation)`` (see the module docstring)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, invocations: tuple[int, ...]) -> None:
        super().__init__()
        width, hd = cfg.attention_hidden_size, cfg.attention_head_dim
        self.input_layernorm = RMSNorm(width, cfg.rms_norm_eps, dtype)
        rank = cfg.adapter_rank if cfg.use_shared_attention_adapter else 0
        self.self_attn = Attention(
            AttentionDims(
                hidden_size=width,
                num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads,
                head_dim=hd,
                bias=False,
                scale=(hd / 2) ** -0.5,
                output_size=cfg.hidden_size,
                adapter_rank=rank,
                adapter_invocations=invocations,
            ),
            dtype,
        )
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.feed_forward = DenseMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            dtype,
            fused_names=("gate_up_proj", "down_proj"),
            act=cfg.hidden_act,
            bias=bool(cfg.add_bias_linear),
            adapter_rank=cfg.adapter_rank,
            adapter_invocations=invocations,
        )

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, ref: StateRef, invocation: int) -> torch.Tensor:
        assert ctx.embeddings is not None
        x = self.input_layernorm(torch.cat([hidden, ctx.embeddings], dim=-1))
        x = self.self_attn(x, ctx, ref, adapter=invocation)
        return self.feed_forward(self.pre_ff_layernorm(x), adapter=invocation)


class Zamba2HybridLayer(nn.Module):
    """The j-th hybrid layer: shared block j % num_mem_blocks -> ``linear`` -> the Mamba2 layer.

    The block is a child of every hybrid layer that uses it (one module, one set of weights);
    only its first user's checkpoint names are required.
    """

    def __init__(
        self,
        block: Zamba2SharedBlock,
        first_use: bool,
        invocation: int,
        cfg: Any,
        dtype: torch.dtype,
        sites: StateSites,
    ) -> None:
        super().__init__()
        self.shared_transformer = block
        self.attn_ref: StateRef = sites.add(block.self_attn)  # this invocation's own KV
        self.linear = linear(cfg.hidden_size, cfg.hidden_size, False, dtype)
        self.mamba_decoder = Zamba2MambaLayer(cfg, dtype, sites)
        self.first_use, self.invocation = first_use, invocation

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        t = self.shared_transformer(hidden, ctx, self.attn_ref, self.invocation)
        return self.mamba_decoder(hidden, ctx, extra=self.linear(t))

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return shared_child_targets(self, prefix, "shared_transformer", self.first_use)


class Zamba2ForCausalLM(HybridForCausalLM):
    final_norm_name = "final_layernorm"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        unknown = sorted(set(cfg.layers_block_type) - {LINEAR_ATTENTION, HYBRID})
        if unknown:
            raise ValueError(f"layers_block_type has unsupported entries {unknown}")
        if len(cfg.layers_block_type) != cfg.num_hidden_layers:
            raise ValueError(
                f"layers_block_type has {len(cfg.layers_block_type)} entries, num_hidden_layers={cfg.num_hidden_layers}"
            )
        check_mamba_dims(
            cfg, mamba_dims(cfg), int(cfg.mamba_expand * cfg.hidden_size), "mamba_expand * hidden_size", act_field=None
        )
        if cfg.use_shared_attention_adapter and cfg.num_key_value_heads != cfg.num_attention_heads:
            raise ValueError(
                f"use_shared_attention_adapter with num_key_value_heads="
                f"{cfg.num_key_value_heads} != num_attention_heads="
                f"{cfg.num_attention_heads}: the k/v adapters are attention_hidden_size "
                "wide, so transformers cannot run it either"
            )
        if cfg.num_mem_blocks < 1:
            raise ValueError(f"num_mem_blocks={cfg.num_mem_blocks} must be at least 1")
        if cfg.use_mem_rope:
            default_rope(cfg, cfg.attention_head_dim, partial_factor=1.0)

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], RMSNorm]:
        num_hybrid, num_blocks = cfg.layers_block_type.count(HYBRID), cfg.num_mem_blocks

        def new_block(b: int) -> Zamba2SharedBlock:
            return Zamba2SharedBlock(cfg, dtype, tuple(range(b, num_hybrid, num_blocks)))

        shared = bool(getattr(cfg, "tie_word_embeddings", False))  # see the module docstring
        blocks = [new_block(b) for b in range(min(num_blocks, num_hybrid))] if shared else []
        layers: list[nn.Module] = []
        invocation = 0
        for kind in cfg.layers_block_type:
            if kind == LINEAR_ATTENTION:
                layers.append(Zamba2MambaLayer(cfg, dtype, sites))
                continue
            b = invocation % num_blocks
            block, first_use = (blocks[b], invocation < num_blocks) if shared else (new_block(b), True)
            layers.append(Zamba2HybridLayer(block, first_use, invocation, cfg, dtype, sites))
            invocation += 1
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        if not cfg.use_mem_rope:
            return None
        return default_rope(cfg, cfg.attention_head_dim, partial_factor=1.0)
