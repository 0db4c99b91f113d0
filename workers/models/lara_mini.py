"""Lara-4-Mini (``LaraMiniForCausalLM``): Qwen3.5's Gated DeltaNet + Qwen3 attention, every
layer an MoE.

What differs from Qwen3-Next (``qwen3_next.py``), all of it from transformers' LaraMini:

- every RMSNorm is plain (``weight * x``, in fp32), not zero-centred; the GDN's gated norm
  too (``norm(x) * silu(z)`` per value head);
- the GDN is Qwen3.5's (``SplitGatedDeltaNet``); the checkpoints fuse its projections into
  one ``linear_attn.in_proj`` (rows ``[q | k | v | z | b | a]``, split here at load) and
  name its gated norm ``out_norm``; the unfused names load as well;
- attention (``layer_types``): ``sliding_attention`` layers see the last ``sliding_window``
  positions with RoPE over the whole head (the paged KV keeps every token, the pages before
  the window are not read, as Lfm3's sliding layers); ``full_attention`` layers have no
  positional encoding. Qwen3 attention: no output gate, plain per-head q/k RMSNorms;
- MoE in every layer: fp32 router logits, softmax, top-k (renormalised with
  ``norm_topk_prob``), and the shared expert added in full, without a gate; experts load
  from the fused (``experts.gate_up_proj`` / ``down_proj``) or the per-expert layout.

Config fields read: ``layer_types``, ``sliding_window``, ``head_dim``, ``attention_bias``,
``rope_parameters`` (``rope_theta``), the ``linear_*`` GDN dims, ``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
``norm_topk_prob``, ``rms_norm_eps``, ``tie_word_embeddings``. Refused: ``hidden_act`` other
than silu, ``rope_type`` other than default, a ``partial_rotary_factor`` other than 1
(transformers' LaraMini rotates the whole head whatever it says), unknown layer types, a
non-positive ``sliding_window``. Not math: ``router_aux_loss_coef``, ``output_router_logits``,
``attention_dropout``, ``max_position_embeddings``. No MTP layers in the architecture.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kernels import dense
from workers.models.base import FULL_ATTENTION, LINEAR_ATTENTION, HybridDecoderLayer, HybridForCausalLM
from workers.models.gated_deltanet import SplitGatedDeltaNet
from workers.models.layers import Attention, AttentionDims, LayerContext, RMSNorm, RotaryEmbedding
from workers.models.moe import MoeDims, SparseMoE, unfuse_expert_tensors
from workers.models.qwen3_next import gdn_dims, head_dim
from workers.models.weights import WeightTarget, module_targets, whole
from workers.state_spec import StateSites

SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (LINEAR_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)
_IN_PROJ = re.compile(r"^(.*\.linear_attn\.)in_proj\.weight$")
_OUT_NORM = re.compile(r"\.linear_attn\.out_norm\.")


class LaraMoE(SparseMoE):
    """Qwen-style routing with fp32 router logits; the shared expert is added without a gate."""

    def __init__(self, dims: MoeDims, dtype: torch.dtype) -> None:
        super().__init__(dims, dtype)
        del self.shared_expert_gate

    def forward(self, x: torch.Tensor, expert_input: torch.Tensor | None = None) -> torch.Tensor:
        out = self._routed(x, *self._route(x))
        assert self.shared_expert is not None
        return out + self.shared_expert(x)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = dense.plain_linear(x.float(), self.router_weight.float())
        top_probs, top_ids = torch.softmax(logits, dim=-1).topk(self.dims.top_k, dim=-1)
        if self.dims.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        return top_probs.to(x.dtype), top_ids

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        assert self.w_gate is not None and self.shared_expert is not None
        targets = {f"{prefix}gate.weight": whole(self.router_weight)}
        for e in range(self.dims.num_experts):
            for name, stacked in (("gate_proj", self.w_gate), ("up_proj", self.w_up), ("down_proj", self.w_down)):
                targets[f"{prefix}experts.{e}.{name}.weight"] = whole(stacked[e])
        return {**targets, **module_targets(self.shared_expert, f"{prefix}shared_expert.")}


class LaraDecoderLayer(HybridDecoderLayer):
    """Qwen's decoder layer; ``rope=False`` runs the mixer without positions (NoPE)."""

    def __init__(self, *args: Any, rope: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rope = rope

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        return super().forward(hidden, ctx if self.rope else ctx._replace(rope=None))


class LaraMiniForCausalLM(HybridForCausalLM):
    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
        kinds = list(cfg.layer_types or [])
        if len(kinds) != cfg.num_hidden_layers:
            raise ValueError(f"layer_types has {len(kinds)} entries, num_hidden_layers={cfg.num_hidden_layers}")
        unknown = sorted(set(kinds) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unsupported layer types {unknown}; expected one of {LAYER_TYPES}")
        if SLIDING_ATTENTION in kinds and (cfg.sliding_window is None or cfg.sliding_window < 1):
            raise ValueError(f"sliding_window={cfg.sliding_window!r}: sliding_attention layers need a positive window")
        gdn_dims(cfg).validate()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} is not a multiple "
                f"of num_key_value_heads={cfg.num_key_value_heads}"
            )
        cls._rotary(cfg)

    @staticmethod
    def _rotary(cfg: Any) -> RotaryEmbedding:
        params = dict(cfg.rope_parameters or {})
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type={params['rope_type']!r} is not supported (only 'default')")
        partial = params.get("partial_rotary_factor")
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"partial_rotary_factor={partial} is not supported (transformers' LaraMini rotates the whole head)"
            )
        return RotaryEmbedding(head_dim(cfg), float(params.get("rope_theta", 10000.0)))

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[LaraDecoderLayer], RMSNorm]:
        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

        moe = MoeDims(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            style="qwen",
            norm_topk_prob=bool(cfg.norm_topk_prob),
            shared_intermediate_size=cfg.shared_expert_intermediate_size,
        )
        layers = []
        for kind in cfg.layer_types:
            mixer: torch.nn.Module
            if kind == LINEAR_ATTENTION:
                name, mixer = "linear_attn", SplitGatedDeltaNet(gdn_dims(cfg), dtype)
            else:
                name, mixer = "self_attn", Attention(self._attention_dims(cfg, kind), dtype)
            ffn = LaraMoE(moe, dtype)
            ref = sites.add(mixer)
            layers.append(LaraDecoderLayer(name, mixer, ref, {"mlp": ffn}, norm(), norm(), rope=kind != FULL_ATTENTION))
        return layers, norm()

    @staticmethod
    def _attention_dims(cfg: Any, kind: str) -> AttentionDims:
        hd = head_dim(cfg)
        return AttentionDims(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=hd,
            bias=bool(cfg.attention_bias),
            scale=hd**-0.5,
            qk_norm_eps=cfg.rms_norm_eps,
            qk_norm_zero_centered=False,
            sliding_window=cfg.sliding_window if kind == SLIDING_ATTENTION else None,
        )

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return self._rotary(cfg)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``out_norm`` -> ``norm``; the fused ``in_proj`` split into its four projections
        (sized as this model's); fused experts split per expert."""
        d = gdn_dims(self.config)
        sizes = {
            "in_proj_qkv": d.conv_dim,
            "in_proj_z": d.num_v_heads * d.v_head_dim,
            "in_proj_b": d.num_v_heads,
            "in_proj_a": d.num_v_heads,
        }

        def split_in_proj() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = _OUT_NORM.sub(".linear_attn.norm.", name)
                fused = _IN_PROJ.match(name)
                if fused is None:
                    yield name, tensor
                    continue
                if tensor.shape[0] != sum(sizes.values()):
                    raise ValueError(
                        f"tensor {name!r} has {tensor.shape[0]} rows; expected {sum(sizes.values())} "
                        f"= [q | k | v | z | b | a] of {sizes}"
                    )
                for part, piece in zip(sizes, tensor.split(list(sizes.values()), dim=0)):
                    yield f"{fused.group(1)}{part}.weight", piece

        return unfuse_expert_tensors(split_in_proj())
