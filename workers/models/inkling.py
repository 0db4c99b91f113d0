"""Inkling (``InklingForCausalLM``, thinkingmachines/Inkling's text model): attention whose k
and v pass through short convolutions, a query-conditioned relative-position bias instead of
RoPE, and short convolutions after the attention and after the MLP.

Layer i (``layer_types[i]``: ``hybrid`` = full attention, ``hybrid_sliding`` = the last
``sliding_window_size`` positions with the ``swa_*`` head counts): ``h += attn_sconv(
self_attn(input_layernorm(h)))``; ``h += mlp_sconv(mlp(post_attention_layernorm(h)))``, the
MLP a scaled SwiGLU (``mlp_layer_types[i] == "dense"``) or the MoE with shared experts
(``workers/models/inkling_layers.py`` has the math). The embedding is RMS-normed
(``embed_tokens.embed_norm``); the final hidden states are divided by
``logits_mup_width_multiplier`` before ``lm_head`` (never tied); an ``unpadded_vocab_size``
below ``vocab_size`` keeps that many logits (the first rows of the padded head), as
transformers slices them.

State per layer: the attention's KV (paged; kind ``attention``, or ``attention_sliding`` for
the sliding layers, whose head shapes may differ) and four conv windows in one slot kind
(``conv_windows`` / ``conv_windows_sliding``): ``k``, ``v`` [kv heads * head_dim, W-1] and
``attn``, ``mlp`` [hidden, W-1], all fp32 as transformers keeps them.

Config fields read: ``layer_types`` (or ``local_layer_ids``, which transformers turns into
it), ``mlp_layer_types``, the head counts and dims of both layer types, ``sliding_window_size``,
``d_rel``, ``rel_extent``, ``log_scaling_n_floor`` / ``log_scaling_alpha``,
``conv_kernel_size``, ``rms_norm_eps``, ``intermediate_size``, ``moe_intermediate_size``,
``n_routed_experts``, ``num_experts_per_tok``, ``n_shared_experts``, ``route_scale``,
``logits_mup_width_multiplier``, ``unpadded_vocab_size``. Refused: ``hidden_act`` other than
silu, ``unpadded_vocab_size`` above ``vocab_size``, ``shared_expert_sink: false``
(transformers 5.24 ignores it and always sinks), ``n_shared_experts`` < 1 with sparse
layers. Not math here: ``rms_norm_eps_moe_gate`` (unused by transformers 5.24),
``attention_dropout``, ``max_position_embeddings``, init fields. MTP layers (``model.mtp.*``)
are skipped on load, as transformers 5.24 skips them (``spec.method: mtp`` is refused). The
multimodal ``InklingForConditionalGeneration`` serves this text model (``inkling_mm.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from workers.models.base import HybridForCausalLM
from workers.models.inkling_layers import InklingAttention, InklingAttentionDims, InklingMoE, ResidualConv, ScaledMLP
from workers.models.layers import LayerContext, RMSNorm, RotaryEmbedding
from workers.models.moe import MoeDims, unfuse_expert_tensors
from workers.state_spec import ATTENTION, CONV_WINDOWS, StateKind, StateSites, conv_windows_kind

HYBRID, HYBRID_SLIDING = "hybrid", "hybrid_sliding"
DENSE, SPARSE = "dense", "sparse"


def attention_dims(cfg: Any, layer_type: str) -> InklingAttentionDims:
    sliding = layer_type == HYBRID_SLIDING
    return InklingAttentionDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.swa_num_attention_heads if sliding else cfg.num_attention_heads,
        num_kv_heads=cfg.swa_num_key_value_heads if sliding else cfg.num_key_value_heads,
        head_dim=cfg.swa_head_dim if sliding else cfg.head_dim,
        d_rel=cfg.d_rel,
        rel_extent=cfg.sliding_window_size if sliding else cfg.rel_extent,
        conv_width=cfg.conv_kernel_size,
        eps=cfg.rms_norm_eps,
        window=cfg.sliding_window_size if sliding else None,
        log_floor=None if sliding else cfg.log_scaling_n_floor,
        log_alpha=float(cfg.log_scaling_alpha),
        kind=f"{ATTENTION}_sliding" if sliding else ATTENTION,
        heads_field="swa_num_attention_heads" if sliding else "num_attention_heads",
    )


def moe_dims(cfg: Any) -> MoeDims:
    return MoeDims(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.moe_intermediate_size,
        num_experts=cfg.n_routed_experts,
        top_k=cfg.num_experts_per_tok,
        style="sigmoid_grouped",
        norm_topk_prob=False,
        routed_scaling_factor=float(cfg.route_scale),
    )


class ConvWindowsLayer(nn.Module):
    """A layer whose ``conv_windows`` slot state is its attention's k / v windows (KV heads,
    maybe TP-narrowed) and its ``attn_sconv`` / ``mlp_sconv`` windows over the hidden size."""

    self_attn: nn.Module
    attn_sconv: ResidualConv
    conv_kind_name: str

    def state_kind(self) -> StateKind:
        kv, hidden = self.self_attn.kv_width, self.attn_sconv.conv1d.weight.shape[0]
        windows = (("k", kv), ("v", kv), ("attn", hidden), ("mlp", hidden))
        width = self.attn_sconv.conv1d.weight.shape[-1]
        return conv_windows_kind(windows, width, self.conv_kind_name, replicated=("attn", "mlp"))


class InklingDecoderLayer(ConvWindowsLayer):
    def __init__(self, cfg: Any, layer_type: str, mlp_type: str, dtype: torch.dtype, sites: StateSites) -> None:
        super().__init__()
        h, eps, width = cfg.hidden_size, cfg.rms_norm_eps, cfg.conv_kernel_size
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = InklingAttention(attention_dims(cfg, layer_type), dtype)
        self.attn_sconv = ResidualConv(h, width)
        self.mlp_sconv = ResidualConv(h, width)
        self.mlp: nn.Module
        if mlp_type == SPARSE:
            self.mlp = InklingMoE(moe_dims(cfg), cfg.n_shared_experts, dtype)
        else:
            self.mlp = ScaledMLP(h, cfg.intermediate_size, dtype)
        self.conv_kind_name = CONV_WINDOWS + ("_sliding" if layer_type == HYBRID_SLIDING else "")
        self.kv_ref = sites.add(self.self_attn)
        self.conv_ref = sites.add(self)

    def forward(self, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        convs = ctx.pools.mamba.layer(self.conv_ref)
        x = self.self_attn(self.input_layernorm(hidden), ctx, self.kv_ref, convs)
        hidden = hidden + self.attn_sconv(x, convs["attn"], ctx.batch)
        x = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + self.mlp_sconv(x, convs["mlp"], ctx.batch)


class NormedEmbedding(nn.Embedding):
    """The token embedding followed by its RMSNorm (``embed_tokens.embed_norm``)."""

    def __init__(self, vocab_size: int, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(vocab_size, hidden_size, dtype=dtype)
        self.embed_norm = RMSNorm(hidden_size, eps, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().forward(ids))


def _check_types(cfg: Any, field: str, allowed: tuple[str, ...]) -> list[str]:
    kinds = list(getattr(cfg, field) or [])
    if len(kinds) != cfg.num_hidden_layers:
        raise ValueError(f"{field} has {len(kinds)} entries, num_hidden_layers={cfg.num_hidden_layers}")
    unknown = sorted(set(kinds) - set(allowed))
    if unknown:
        raise ValueError(f"{field} has unsupported entries {unknown}; expected {allowed}")
    return kinds


def check_attention_kinds(cfg: Any, kinds: list[str]) -> None:
    """Conv width and each layer type's heads and relative-bias sizes (Inkling and Inkling2)."""
    if cfg.conv_kernel_size < 2:
        raise ValueError(f"conv_kernel_size={cfg.conv_kernel_size} must be at least 2")
    for kind in sorted(set(kinds)):
        d = attention_dims(cfg, kind)
        if d.num_heads % d.num_kv_heads:
            raise ValueError(f"{d.heads_field}={d.num_heads} is not a multiple of its key/value heads")
        if d.rel_extent < 1 or d.d_rel < 1 or (d.window is not None and d.window < 1):
            raise ValueError(f"rel_extent / d_rel / sliding_window_size must be positive ({kind})")


def check_unpadded_vocab(cfg: Any) -> None:
    unpadded = getattr(cfg, "unpadded_vocab_size", None)
    if unpadded is not None and not 0 < unpadded <= cfg.vocab_size:
        raise ValueError(f"unpadded_vocab_size={unpadded} must be in 1..vocab_size={cfg.vocab_size}")


class InklingForCausalLM(HybridForCausalLM):
    ties_embeddings = False  # transformers never ties Inkling's embed and unembed

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hf_config, dtype, device)
        cfg = self.config
        self.logits_scaling = float(getattr(cfg, "logits_mup_width_multiplier", 1.0))  # Inkling2 has none
        self.head_rows = getattr(cfg, "unpadded_vocab_size", None) or cfg.vocab_size
        with torch.device("meta"):
            embedding = NormedEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.model.embed_tokens = embedding.to_empty(device=torch.device(device)).requires_grad_(False)

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        kinds = _check_types(cfg, "layer_types", (HYBRID, HYBRID_SLIDING))
        mlps = _check_types(cfg, "mlp_layer_types", (DENSE, SPARSE))
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported (only 'silu')")
        check_unpadded_vocab(cfg)
        if SPARSE in mlps and not getattr(cfg, "shared_expert_sink", True):
            raise ValueError("shared_expert_sink=False is not supported (transformers 5.24 always sinks)")
        if SPARSE in mlps and cfg.n_shared_experts < 1:
            raise ValueError(f"n_shared_experts={cfg.n_shared_experts}: the router needs at least one shared expert")
        check_attention_kinds(cfg, kinds)

    def lm_head_weight(self) -> torch.Tensor:
        """The head's first ``unpadded_vocab_size`` rows (all of them without one)."""
        return super().lm_head_weight()[: self.head_rows]

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], RMSNorm]:
        layers: list[nn.Module] = [
            InklingDecoderLayer(cfg, kind, mlp, dtype, sites) for kind, mlp in zip(cfg.layer_types, cfg.mlp_layer_types)
        ]
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return None  # positions enter through the relative bias only

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        kept = ((name, t) for name, t in weights if not name.startswith("model.mtp."))
        return unfuse_expert_tensors(kept)
