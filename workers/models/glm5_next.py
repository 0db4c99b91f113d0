"""GLM-5.3-Flash (``Glm5NextForConditionalGeneration``, zai-org/GLM-5.3-Flash): the language model
served, the vision tower skipped (transformers has no text-only class for it).

Layer i, on N = ``hc_mult`` residual streams (``workers/models/mhc.py``): ``attn_hc`` collapses
the streams into the block input, ``self_attn(input_layernorm(.))`` runs, its output is
expanded back into the streams; the same around ``mlp`` with ``ffn_hc`` and
``post_attention_layernorm``. The embedding enters as N copies; the output is the streams'
mean, then ``norm``. ``self_attn`` is, by ``layer_types[i]``:

- ``linear_attention``: KDA (``workers/models/kda.py``, gate ``glm``: Kimi's low-rank
  projections with the decay ``linear_lower_bound * sigmoid(exp(A_log) * g)``, or Kimi's
  softplus decay when the bound is null);
- ``indexed_attention``: MLA without positions over the positions a DSA k-pool indexer selects
  (``workers/models/dsa.py``); ``indexer_types[i]`` ``shared`` reuses the selection of the
  ``full`` layer just before it.

``mlp`` is, by ``mlp_layer_types[i]``, a SwiGLU MLP or the DeepSeek-V3 MoE
(``workers/models/deepseek_moe.py``); every SwiGLU (dense, shared, routed) clips its gate
*before* the activation and its up projection at ``swiglu_limit``
(``moe_experts.swiglu(clip_input=True)``). The released checkpoint's MTP layer
(``layers.{num_hidden_layers}``, ``shared_head``) is skipped, as transformers skips it: it
does not run it, so ``spec.method: mtp`` is refused.

Checkpoint layout: what ``save_pretrained`` writes (``model.language_model.*``, ``model.visual.*``
skipped, top-level ``lm_head``; per layer ``hc_attn_{fn,base,scale}`` / ``hc_ffn_*``, KDA's
``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, ``A_log`` [H], experts per expert); transformers'
runtime names (``attn_hc.fn``, ``forget_gate.*``, fused ``conv1d``, fused experts) load too.

Config fields read: ``hidden_size``, ``num_hidden_layers``, ``layer_types``, ``indexer_types``,
``mlp_layer_types``, ``rms_norm_eps``, ``hc_mult``, ``hc_eps``, ``hc_sinkhorn_iters``,
``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``, ``linear_lower_bound``,
``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
``v_head_dim``, ``attention_bias``, ``index_n_heads``, ``index_head_dim``, ``index_topk``,
``index_kpool``, ``index_kpool_always_select_tail``, ``intermediate_size``,
``moe_intermediate_size``, ``n_routed_experts``, ``num_experts_per_tok``, ``n_group``,
``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``, ``n_shared_experts``,
``swiglu_limit``, ``vocab_size``, ``tie_word_embeddings`` (top level). Refused (ValueError
naming the field): ``hidden_act`` other than silu, ``qk_rope_head_dim`` other than 0,
``num_key_value_heads`` != ``num_attention_heads``, a null ``q_lora_rank``, ``index_topk`` not
a positive multiple of ``index_kpool``, ``index_kpool_always_select_tail`` false (a row before
its first whole block would select nothing; transformers then attends to every position, later
ones too), ``swiglu_limit`` <= 0, ``hc_mult`` or ``hc_sinkhorn_iters`` < 1, a ``shared``
indexer layer not right after a ``full`` indexed layer. Not math: dropout, init,
router-loss, cache and ``max_position_embeddings`` fields (no positional encoding).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.base import HybridForCausalLM
from workers.models.deepseek_moe import DENSE, ClippedMLP, RoutedSharedMoE, check_mlp_layer_types, moe_dims
from workers.models.dsa import IndexedLatentAttention, IndexerDims
from workers.models.kda import KimiDeltaAttention
from workers.models.kimi_linear import check_mla_heads, kda_dims, mla_dims
from workers.models.layers import LayerContext, RMSNorm, RotaryEmbedding
from workers.models.mhc import HyperConnection, expand
from workers.models.moe import unfuse_expert_tensors
from workers.models.weights import merge_split_tensors
from workers.models.wrapped_text import WrappedText
from workers.state_spec import StateSites

LINEAR, INDEXED = "linear_attention", "indexed_attention"
FULL, SHARED = "full", "shared"
_RELEASED_HC = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")


def check_layers(cfg: Any) -> None:
    n = cfg.num_hidden_layers
    for field, allowed in (("layer_types", (LINEAR, INDEXED)), ("indexer_types", (FULL, SHARED))):
        kinds = list(getattr(cfg, field))
        if len(kinds) != n or set(kinds) - set(allowed):
            raise ValueError(f"{field}={kinds} must be {n} entries of {allowed}")
    for i, (kind, mode) in enumerate(zip(cfg.layer_types, cfg.indexer_types)):
        before = (cfg.layer_types[i - 1], cfg.indexer_types[i - 1]) if i else None
        if kind == INDEXED and mode == SHARED and before != (INDEXED, FULL):
            raise ValueError(
                f"indexer_types[{i}]='shared' needs layer {i - 1} to be an indexed_attention layer "
                f"with a 'full' indexer (it reuses that selection), got {before}"
            )
    check_mlp_layer_types(cfg)


def check_fields(cfg: Any) -> None:
    refused = {
        "hidden_act": (cfg.hidden_act, cfg.hidden_act == "silu"),
        "qk_rope_head_dim": (cfg.qk_rope_head_dim, cfg.qk_rope_head_dim == 0),
        "q_lora_rank": (cfg.q_lora_rank, cfg.q_lora_rank is not None),
        "index_topk": (cfg.index_topk, cfg.index_kpool >= 1 and cfg.index_topk % cfg.index_kpool == 0 < cfg.index_topk),
        # without the tail a row before its first whole block selects nothing (transformers then
        # attends to every position, later ones too)
        "index_kpool_always_select_tail": (cfg.index_kpool_always_select_tail, cfg.index_kpool_always_select_tail),
        "swiglu_limit": (cfg.swiglu_limit, cfg.swiglu_limit is not None and cfg.swiglu_limit > 0),
        "hc_mult": (cfg.hc_mult, cfg.hc_mult >= 1),
        "hc_sinkhorn_iters": (cfg.hc_sinkhorn_iters, cfg.hc_sinkhorn_iters >= 1),
    }
    for name, (value, ok) in refused.items():
        if not ok:
            raise ValueError(
                f"{name}={value!r} is not supported by GLM-5.3-Flash (see workers/models/glm5_next.py; "
                f"index_kpool={cfg.index_kpool})"
            )
    check_mla_heads(cfg)


def indexer_dims(cfg: Any) -> IndexerDims:
    return IndexerDims(
        hidden_size=cfg.hidden_size,
        q_lora_rank=cfg.q_lora_rank,
        num_heads=cfg.index_n_heads,
        head_dim=cfg.index_head_dim,
        block_size=cfg.index_kpool,
        top_blocks=cfg.index_topk // cfg.index_kpool,
        tail=bool(cfg.index_kpool_always_select_tail),
    )


def build_ffn(cfg: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    """Dense or DeepSeek MoE, every SwiGLU clipped GLM's way (gate before the activation)."""
    limit = float(cfg.swiglu_limit)
    if cfg.mlp_layer_types[layer_idx] == DENSE:
        return ClippedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, act="silu", limit=limit, clip_input=True)
    dims = replace(moe_dims(cfg), swiglu_limit=limit, swiglu_clip_input=True)
    return RoutedSharedMoE(dims, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, shared_limit=limit)


class Glm5DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, index: int, dtype: torch.dtype, sites: StateSites) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn: nn.Module
        self.indexer_ref = None
        if cfg.layer_types[index] == LINEAR:
            bound = cfg.linear_lower_bound
            kda = kda_dims(cfg, "glm_softplus") if bound is None else kda_dims(cfg, "glm", float(bound))
            self.self_attn = KimiDeltaAttention(kda, dtype)
        else:
            indexer = indexer_dims(cfg) if cfg.indexer_types[index] == FULL else None
            mla = replace(mla_dims(cfg, "none"), norm_eps=eps)
            self.self_attn = IndexedLatentAttention(mla, indexer, dtype)
        self.ref = sites.add(self.self_attn)
        if getattr(self.self_attn, "indexer", None) is not None:
            self.indexer_ref = sites.add(self.self_attn.indexer)
        self.mlp = build_ffn(cfg, index, dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        hc = (cfg.hc_mult, h, eps, cfg.hc_eps, cfg.hc_sinkhorn_iters, dtype)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(
        self, streams: torch.Tensor, ctx: LayerContext, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, N, D]; positions: the last full indexer's selection (for a shared layer)."""
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        attn = self.self_attn
        if isinstance(attn, IndexedLatentAttention):
            q_resid = attn.q_residual(x)
            if attn.indexer is not None:
                positions = attn.indexer(x, q_resid, ctx, self.indexer_ref)
            assert positions is not None, "a shared indexer layer follows a full one (validate_config)"
            x = attn(x, ctx, self.ref, positions, q_resid)
        else:
            x = attn(x, ctx, self.ref)
        streams = expand(x, post, comb, streams)
        post, comb, x = self.ffn_hc(streams)
        x = self.mlp(self.post_attention_layernorm(x))
        return expand(x, post, comb, streams), positions


class Glm5NextTextModel(HybridForCausalLM):
    """GLM-5.3-Flash's language model over ``text_config`` (see the module docstring)."""

    batch_invariant = False  # the native expert loop has no pre-activation clip

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        check_layers(cfg)
        check_fields(cfg)
        mla_dims(cfg, "none").validate()
        kda_dims(cfg, "glm").validate()

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], RMSNorm]:
        layers = [Glm5DecoderLayer(cfg, i, dtype, sites) for i in range(cfg.num_hidden_layers)]
        return layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return None  # no positional encoding anywhere

    def forward(self, batch: ForwardBatch, pools: DevicePools) -> torch.Tensor:
        x = self.model.embedding(batch.input_ids)
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        ctx, positions = LayerContext(batch, pools), None
        for layer in self.model.layers:
            streams, positions = layer(streams, ctx, positions)
        return self.model.final_norm(streams.mean(dim=1))

    def checkpoint_name(self, name: str) -> str:
        name = _RELEASED_HC.sub(lambda m: f".{m.group(1)}_hc.{m.group(2)}", name)
        return name.replace(".forget_gate.", ".")

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        kept = (item for item in weights if not self.is_mtp_tensor(item[0]))
        return super().checkpoint_tensors(unfuse_expert_tensors(merge_split_tensors(kept)))

    def is_mtp_tensor(self, name: str) -> bool:
        """The released MTP layer (``layers.{num_hidden_layers}.*``, ``shared_head``), not run."""
        found = re.search(r"\blayers\.(\d+)\.", name)
        return found is not None and (int(found.group(1)) >= self.config.num_hidden_layers or ".shared_head." in name)


class Glm5NextForConditionalGeneration(WrappedText, Glm5NextTextModel):
    text_model_types = ("glm5_next_text",)
    text_renames = (("model.language_model.", "model."),)
    tower_prefixes = ("model.visual.",)
