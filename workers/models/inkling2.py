"""Inkling2 (``Inkling2ForCausalLM``, thinkingmachines/Inkling-2's text model): Inkling's
convolved, relative-biased attention with clipped q / k, per-token attention sinks, a gated
output and (in full layers) dynamic k / v convs; block attention residuals in place of the
residual stream; a softcapped-SwiGLU MoE in every layer; softcapped logits.

Block attention residuals: every ``n_layers_per_attn_res_block`` layers (layer 0 first) the
layer's input is kept as a completed *block* and the running hidden state restarts from the
layer's attention output; between, the hidden state is the partial sum of the block. A layer
reads its attention input (``attention_input``: one query on sliding layers, three on full
ones, for q, k and v, none on layer 0) and its MLP input (``mlp_input``) as depth attentions
over [the blocks..., the partial block]; the model's output is ``final_input`` over all of
them, then ``norm`` and ``lm_head`` (``unpadded_vocab_size`` rows), logits softcapped at
``final_logit_softcapping``. Layer i (``layer_types[i]``: ``hybrid`` full attention,
``hybrid_sliding`` the last ``sliding_window_size`` positions with the ``swa_*`` heads):
``a = attn_sconv(self_attn(norms(attention_input)))``; ``h = a`` at a block start, else
``h + a``; ``h + mlp_sconv(mlp(post_attention_layernorm(mlp_input)))``. The math of the
pieces is in ``workers/models/inkling2_layers.py``; the block states are values of one
forward pass, never kept between steps.

State per layer: Inkling's (``workers/models/inkling.py``): paged KV (``attention`` /
``attention_sliding``) and four fp32 conv windows (``conv_windows`` / ``..._sliding``): the
dynamic convs keep the same window as the static ones.

Config fields read: ``layer_types``, the head counts and dims of both layer types,
``sliding_window_size``, ``d_rel``, ``rel_extent``, ``log_scaling_n_floor`` /
``log_scaling_alpha``, ``qk_l2_clip_threshold``, ``rel_l2_clip_threshold``,
``n_layers_per_attn_res_block``, ``conv_kernel_size``, ``rms_norm_eps``,
``moe_intermediate_size``, ``n_routed_experts``, ``num_experts_per_tok``, ``route_scale``,
``mlp_gate_softcap``, ``mlp_up_softcap``, ``final_logit_softcapping``,
``unpadded_vocab_size``. Refused: ``scoring_func`` other than sigmoid, a softcap that is not
positive, ``unpadded_vocab_size`` above ``vocab_size``, ``n_layers_per_attn_res_block`` < 1,
``conv_kernel_size`` < 2. Not math here: ``hidden_act`` (transformers' text model never reads
it), ``attention_dropout``, ``max_position_embeddings``, init fields. Checkpoints: the layout
transformers 5.24 writes with ``save_pretrained`` (the released one: ``model.llm.*``,
``attn_res.*`` queries, gate / up interleaved; see ``checkpoint_tensors``); ``model.mtp.*``
is skipped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import Tensor, nn

from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models import inkling
from workers.models.inkling import (
    HYBRID,
    HYBRID_SLIDING,
    ConvWindowsLayer,
    InklingForCausalLM,
    _check_types,
    check_attention_kinds,
    check_unpadded_vocab,
)
from workers.models.inkling2_layers import (
    DepthAttention,
    Inkling2Attention,
    Inkling2AttentionDims,
    Inkling2MoE,
    softcap,
)
from workers.models.inkling_layers import ResidualConv
from workers.models.inkling_mm import released_names
from workers.models.layers import LayerContext, RMSNorm
from workers.models.moe import MoeDims
from workers.state_spec import CONV_WINDOWS, StateSites

# The released layout keeps the depth queries beside the layers: ``attn_queries.{i}`` is
# layer i + 1's (layer 0 has none).
_DEPTH_QUERIES = (
    (
        re.compile(r"^model\.llm\.attn_res\.attn_queries\.(\d+)$"),
        lambda m: f"model.layers.{int(m[1]) + 1}.attention_input.query",
    ),
    (re.compile(r"^model\.llm\.attn_res\.mlp_queries\.(\d+)$"), lambda m: f"model.layers.{m[1]}.mlp_input.query"),
    (re.compile(r"^model\.llm\.attn_res\.output_query$"), lambda m: "model.final_input.query"),
    (
        re.compile(r"^model\.llm\.middle_cycle_cross_pass_(kv_)?queries$"),
        lambda m: f"model.message_input.{m[1] or ''}queries",
    ),
)


def attention_dims(cfg: Any, layer_type: str) -> Inkling2AttentionDims:
    """Inkling's dims of the layer type plus the clip thresholds."""
    base = inkling.attention_dims(cfg, layer_type)
    return Inkling2AttentionDims(
        **asdict(base), qk_clip=float(cfg.qk_l2_clip_threshold), rel_clip=float(cfg.rel_l2_clip_threshold)
    )


def moe_dims(cfg: Any) -> MoeDims:
    """Inkling's, the chosen scores renormalised among themselves (no shared experts)."""
    return replace(inkling.moe_dims(cfg), norm_topk_prob=True)


class Inkling2DecoderLayer(ConvWindowsLayer):
    """One layer, invoked ``num_passes`` times (a looped layer keeps a state per invocation)."""

    def __init__(self, cfg: Any, index: int, dtype: torch.dtype, sites: StateSites, num_passes: int = 1) -> None:
        super().__init__()
        h, eps, width = cfg.hidden_size, cfg.rms_norm_eps, cfg.conv_kernel_size
        self.sliding = cfg.layer_types[index] == HYBRID_SLIDING
        self.starts_block = index % cfg.n_layers_per_attn_res_block == 0
        self.attention_input = DepthAttention(h, 1 if self.sliding else 3) if index > 0 else None
        self.mlp_input = DepthAttention(h)
        self.self_attn = Inkling2Attention(attention_dims(cfg, cfg.layer_types[index]), dtype)
        self.mlp = Inkling2MoE(moe_dims(cfg), float(cfg.mlp_gate_softcap), float(cfg.mlp_up_softcap), dtype)
        names = ("input_layernorm",) if self.sliding else ("q_input_norm", "k_input_norm", "v_input_norm")
        for name in names:
            self.add_module(name, RMSNorm(h, eps, dtype))
        self.norm_names = names * 3 if self.sliding else names
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.attn_sconv = ResidualConv(h, width, 1.0 / math.sqrt(width + 1))
        self.mlp_sconv = ResidualConv(h, width, 1.0 / math.sqrt(width + 1))
        self.conv_kind_name = CONV_WINDOWS + ("_sliding" if self.sliding else "")
        self.refs = [(sites.add(self.self_attn), sites.add(self)) for _ in range(num_passes)]

    def attention_sources(self, hidden: Tensor, blocks: list[Tensor]) -> list[Tensor]:
        """The q / k / v inputs before their norms (fp32 from the depth attention)."""
        if self.attention_input is None:
            return [hidden] * 3
        picked = self.attention_input(blocks, hidden)
        return [picked[:, 0]] * 3 if self.sliding else list(picked.unbind(1))

    def forward(
        self,
        hidden: Tensor,
        blocks: list[Tensor],
        ctx: LayerContext,
        invocation: int = 0,
        messages: Tensor | None = None,
    ) -> Tensor:
        """``hidden`` [T, hidden] -> the next; appends ``hidden`` to ``blocks`` when this layer
        starts a block. ``messages`` [T, 4, hidden]: a looped layer's later passes."""
        kv_ref, conv_ref = self.refs[invocation]
        convs, dtype = ctx.pools.mamba.layer(conv_ref), hidden.dtype
        sources = self.attention_sources(hidden, blocks)
        if messages is not None:
            sources = [self.message_gate(i, s, messages) for i, s in enumerate(sources)]
        if self.sliding and messages is None:
            xs = (self.input_layernorm(sources[0]).to(dtype),) * 3
        else:
            xs = tuple(getattr(self, n)(s).to(dtype) for n, s in zip(self.norm_names, sources))
        out = self.attn_sconv(self.self_attn(xs, ctx, kv_ref, convs), convs["attn"], ctx.batch).float()
        if self.starts_block:
            blocks.append(hidden)
        else:
            out = hidden.float() + out
        x = self.mlp_input(blocks, out)[:, 0]
        if messages is not None:
            x = self.message_gate(3, x, messages)
        x = self.mlp(self.post_attention_layernorm(x).to(dtype))
        return (out + self.mlp_sconv(x, convs["mlp"], ctx.batch).float()).to(dtype)

    def message_gate(self, index: int, x: Tensor, messages: Tensor) -> Tensor:
        raise NotImplementedError("only a looped layer takes messages")


def check_inkling2_config(cfg: Any) -> None:
    kinds = _check_types(cfg, "layer_types", (HYBRID, HYBRID_SLIDING))
    check_unpadded_vocab(cfg)
    if cfg.scoring_func != "sigmoid":
        raise ValueError(f"scoring_func={cfg.scoring_func!r} is not supported (only 'sigmoid')")
    for field in ("mlp_gate_softcap", "mlp_up_softcap", "final_logit_softcapping"):
        value = getattr(cfg, field)
        if value is None or value <= 0:
            raise ValueError(f"{field}={value!r} must be positive")
    if cfg.n_layers_per_attn_res_block < 1:
        raise ValueError(f"n_layers_per_attn_res_block={cfg.n_layers_per_attn_res_block} must be at least 1")
    check_attention_kinds(cfg, kinds)


class Inkling2ForCausalLM(InklingForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hf_config, dtype, device)
        self.logit_cap = float(self.config.final_logit_softcapping)
        with torch.device("meta"):
            final_input = DepthAttention(self.config.hidden_size)
        self.model.final_input = final_input.to_empty(device=torch.device(device)).requires_grad_(False)

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_inkling2_config(cfg)

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], RMSNorm]:
        layers: list[nn.Module] = [Inkling2DecoderLayer(cfg, i, dtype, sites) for i in range(cfg.num_hidden_layers)]
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, batch: ForwardBatch, pools: DevicePools) -> Tensor:
        hidden = self.model.embedding(batch.input_ids)
        ctx = LayerContext(batch, pools, None, hidden)
        blocks: list[Tensor] = []
        hidden = self.run_layers(hidden, blocks, ctx)
        out = self.model.final_norm(self.model.final_input(blocks, hidden)[:, 0])
        return out.to(self.dtype)

    def run_layers(self, hidden: Tensor, blocks: list[Tensor], ctx: LayerContext) -> Tensor:
        for layer in self.model.layers:
            hidden = layer(hidden, blocks, ctx)
        return hidden

    def logits_from(self, hidden: Tensor, weight: Tensor) -> Tensor:
        return softcap(super().logits_from(hidden, weight), self.logit_cap)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        def renamed() -> Iterator[tuple[str, Tensor]]:
            for name, t in weights:
                for pattern, target in _DEPTH_QUERIES:
                    name = pattern.sub(target, name)
                if name.endswith("sconv.static_w"):  # [W, C] newest tap first -> conv1d [C, 1, W]
                    name, t = name[: -len("static_w")] + "conv1d.weight", t.flip(0).t()[:, None, :]
                yield from released_names(name, t)

        return super().checkpoint_tensors(renamed())
