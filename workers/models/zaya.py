"""ZAYA1 (``ZayaForCausalLM``): compressed convolutional attention and a top-1 MoE with a
skip expert in every layer.

The residual stream is fp32 (transformers' ``residual_in_fp32``): embeddings become
``(e + model.input_hidden_states_bias) * model.input_hidden_states_scale``; layer i is
``r = post_attention_residual_scale(self_attn(input_layernorm(h)), h)``, then
``h = post_mlp_residual_scale(mlp(post_attention_layernorm(r)), r)``, each scale
``(x + hidden_states_bias) * hidden_states_scale + (r + residual_bias) * residual_scale``;
the norms read the stream cast to the model dtype. ``self_attn`` is CCA
(``workers/models/cca.py``): every layer keeps an ``attention`` KV and a ``cca`` state, as
Falcon-H1 keeps two kinds in one layer. ``hybrid_sliding`` layers attend to the last
``sliding_window`` positions; each layer type has its own partial RoPE
(``rope_parameters[type]``).

The MoE (``mlp``): the router (``mlp.gate``) projects to ``router_hidden_size``, adds the
previous layer's router state times ``router_states_scale`` (layers after the first: the
state passes from layer to layer within a token, never between steps), then RMSNorm, two
GELU layers and ``out_proj`` give logits over ``num_experts + 1`` classes; the softmax plus
``balancing_biases`` picks one, whose softmax probability weights its expert (unrenormalised);
the last class is the skip expert (no expert, weight 0), whose balancing bias is -1 whatever
the checkpoint holds, as in transformers 5.24 (its weight init sets it after loading). Experts
are SwiGLU (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``), run by
``moe.SparseMoE``'s loop; under TP they split as every MoE's, the router is replicated.

Config fields read: ``layer_types``, ``sliding_window``, ``rope_parameters`` (per type),
``head_dim``, ``num_attention_heads``, ``num_key_value_heads``, ``attention_bias``,
``cca_time0``, ``cca_time1``, ``rms_norm_eps``, ``hidden_act``, ``num_experts``,
``moe_intermediate_size``, ``router_hidden_size``, ``tie_word_embeddings``. Refused (named):
``num_experts_per_tok`` other than 1 (transformers refuses it too), ``lm_head_bias``, a
``rope_type`` other than default, ``cca_time0`` < 2, ``cca_time1`` < 1. Not math: ``attention_dropout``,
``output_router_logits``, ``max_position_embeddings``, init fields.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.base import Backbone, HybridForCausalLM
from workers.models.cca import CcaDims, ZayaAttention
from workers.models.layers import LayerContext, RMSNorm, RotaryEmbedding, activation, linear, param
from workers.models.moe import MoeDims, SparseMoE
from workers.models.weights import WeightTarget, split, whole
from workers.state_spec import StateSites

HYBRID, HYBRID_SLIDING = "hybrid", "hybrid_sliding"
SKIP_BIAS = -1.0  # balancing_biases[-1], whatever the checkpoint holds (see the module docstring)


class ZayaResidualScaling(nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        for name in ("hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"):
            setattr(self, name, param(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return (x + self.hidden_states_bias) * self.hidden_states_scale + (
            residual + self.residual_bias
        ) * self.residual_scale


class ZayaRouterMLP(nn.Module):
    def __init__(self, size: int, num_classes: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(size, eps, dtype)
        self.fc1 = linear(size, size, True, dtype)
        self.fc2 = linear(size, size, True, dtype)
        self.out_proj = linear(size, num_classes, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(x))))))


class ZayaRouter(nn.Module):
    """``mlp.gate``: -> (weights [T, 1], expert ids [T, 1], the router state for the next layer)."""

    def __init__(self, cfg: Any, first: bool, dtype: torch.dtype) -> None:
        super().__init__()
        size, self.num_experts = cfg.router_hidden_size, cfg.num_experts
        self.down_proj = linear(cfg.hidden_size, size, True, dtype)
        self.router_states_scale = None if first else param(size, dtype=dtype)
        self.router_mlp = ZayaRouterMLP(size, self.num_experts + 1, cfg.rms_norm_eps, dtype)
        self.balancing_biases = param(self.num_experts + 1, dtype=torch.float32)

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        state = self.down_proj(x)
        if self.router_states_scale is not None and prev is not None:
            state = state + prev * self.router_states_scale
        probs = torch.softmax(self.router_mlp(state), dim=-1)
        ids = (probs.float() + self.balancing_biases).topk(1, dim=-1)[1]
        weights = probs.gather(1, ids)
        skip = ids == self.num_experts  # the skip expert: no expert, weight 0
        return weights.masked_fill(skip, 0), ids.masked_fill(skip, 0), state


class ZayaExperts(SparseMoE):
    """The routed SwiGLU experts (routing is ``ZayaRouter``'s); TP shards them as any MoE's."""

    def __init__(self, dims: MoeDims, dtype: torch.dtype) -> None:
        super().__init__(dims, dtype)
        del self.router_weight

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self._routed(x, weights, ids)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        assert self.w_gate is not None
        return {f"{prefix}gate_up_proj": split(1, self.w_gate, self.w_up), f"{prefix}down_proj": whole(self.w_down)}


class ZayaMoE(nn.Module):
    def __init__(self, cfg: Any, first: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = ZayaRouter(cfg, first, dtype)
        dims = MoeDims(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, 1, "qwen", act=cfg.hidden_act)
        self.experts = ZayaExperts(dims, dtype)

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids, state = self.gate(x, prev)
        return self.experts(x, weights, ids), state


def head_dim(cfg: Any) -> int:
    return int(cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)


def cca_dims(cfg: Any, layer_type: str) -> CcaDims:
    return CcaDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim(cfg),
        depthwise_width=int(cfg.cca_time0),
        grouped_width=int(cfg.cca_time1),
        bias=bool(cfg.attention_bias),
        sliding_window=cfg.sliding_window if layer_type == HYBRID_SLIDING else None,
        total_kv_heads=cfg.num_key_value_heads,
    )


class ZayaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, index: int, dtype: torch.dtype, sites: StateSites) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[index]
        self.self_attn = ZayaAttention(cca_dims(cfg, self.layer_type), dtype)
        self.self_attn.cca_ref = sites.add(self.self_attn.qkv_proj)
        self.attn_ref = sites.add(self.self_attn)
        self.mlp = ZayaMoE(cfg, index == 0, dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_residual_scale = ZayaResidualScaling(h, dtype)
        self.post_mlp_residual_scale = ZayaResidualScaling(h, dtype)

    def forward(
        self, hidden: torch.Tensor, router: torch.Tensor | None, ctx: LayerContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.input_layernorm.weight.dtype
        x = self.self_attn(self.input_layernorm(hidden.to(dtype)), ctx, self.attn_ref)
        hidden = self.post_attention_residual_scale(x, hidden)
        x, router = self.mlp(self.post_attention_layernorm(hidden.to(dtype)), router)
        return self.post_mlp_residual_scale(x, hidden), router


def layer_rotary(cfg: Any, layer_type: str) -> RotaryEmbedding:
    params = dict((cfg.rope_parameters or {}).get(layer_type) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_parameters[{layer_type!r}].rope_type={rope_type!r} is not supported (only 'default')")
    if params.get("rope_theta") is None:
        raise ValueError(f"rope_parameters[{layer_type!r}] has no rope_theta")
    dim = int(head_dim(cfg) * float(params.get("partial_rotary_factor", 1.0)))
    return RotaryEmbedding(dim, float(params["rope_theta"]))


class ZayaForCausalLM(HybridForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hf_config, dtype, device)
        h = self.config.hidden_size
        for name in ("input_hidden_states_scale", "input_hidden_states_bias"):
            tensor = torch.empty(h, dtype=dtype, device=torch.device(device))
            self.model.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.rotaries = {kind: layer_rotary(self.config, kind) for kind in sorted(set(self.config.layer_types))}

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        kinds = list(cfg.layer_types or [HYBRID] * cfg.num_hidden_layers)
        if len(kinds) != cfg.num_hidden_layers or set(kinds) - {HYBRID, HYBRID_SLIDING}:
            raise ValueError(
                f"layer_types={kinds} must be {cfg.num_hidden_layers} entries of {HYBRID!r} / {HYBRID_SLIDING!r}"
            )
        if HYBRID_SLIDING in kinds and not (cfg.sliding_window or 0) > 0:
            raise ValueError(f"sliding_window={cfg.sliding_window!r}: hybrid_sliding layers need a positive window")
        refused = {
            "num_experts_per_tok": (cfg.num_experts_per_tok, cfg.num_experts_per_tok == 1),
            "lm_head_bias": (cfg.lm_head_bias, not cfg.lm_head_bias),
            "cca_time0": (cfg.cca_time0, int(cfg.cca_time0) >= 2),
            "cca_time1": (cfg.cca_time1, int(cfg.cca_time1) >= 1),
        }
        for name, (value, ok) in refused.items():
            if not ok:
                raise ValueError(f"{name}={value!r} is not supported by ZayaForCausalLM")
        if cfg.num_key_value_heads * head_dim(cfg) % 2:
            raise ValueError("num_key_value_heads * head_dim must be even (the value is half current, half delayed)")
        activation(cfg.hidden_act)
        for kind in sorted(set(kinds)):
            layer_rotary(cfg, kind)

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], RMSNorm]:
        layers = [ZayaDecoderLayer(cfg, i, dtype, sites) for i in range(cfg.num_hidden_layers)]
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return None  # one RoPE per layer type (``self.rotaries``)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        for layer in self.model.layers:  # transformers 5.24's init overrides the checkpoint's skip bias
            layer.mlp.gate.balancing_biases.data[-1] = SKIP_BIAS

    def forward(self, batch: ForwardBatch, pools: DevicePools) -> torch.Tensor:
        m: Backbone = self.model
        x = m.embedding(batch.input_ids)
        hidden = ((x + m.input_hidden_states_bias) * m.input_hidden_states_scale).float()
        ctxs = {k: LayerContext(batch, pools, r.tables(batch.positions, x.dtype)) for k, r in self.rotaries.items()}
        router = None
        for layer in m.layers:
            hidden, router = layer(hidden, router, ctxs[layer.layer_type])
        return m.final_norm(hidden.to(self.dtype))
