"""Qwen4-Exp (``Qwen4ExpForCausalLM``; the text part of ``Qwen4ExpForConditionalGeneration``).

Qwen3.5-MoE's Gated DeltaNet (``linear_attention``) and gated attention, with three changes
(the pieces are in ``qwen4_exp_layers.py`` and ``qwen4_exp_ple.py``):

- hyper-connections: the residual is ``hc_count`` streams of the hidden size (the embedding
  repeated); each mixer and each MoE reads a gated mix of the normed streams (no input
  layernorm) and is added back to every stream with its own weight; the final
  ``hyper_connection_mixer`` reads the streams into the hidden state the head sees (no
  final norm);
- ``indexed_attention`` layers (``full_attention`` in the released config means the same):
  attention over the positions the QSA indexer selects (blocks of ``indexer_compress_ratio``
  tokens, the best ``indexer_budget / indexer_compress_ratio`` complete ones plus the
  query's partial block);
- per-layer n-gram embeddings (``ple_layer_ids``, 1-indexed GDN layers): added to the streams
  before the layer.

Every layer's feed-forward is the Qwen MoE (softmax top-k, ``norm_topk_prob`` read, plus the
sigmoid-gated shared expert). RoPE as Qwen3.5's (text positions: multimodal RoPE is plain
RoPE on ``partial_rotary_factor`` of ``head_dim``).

State per layer: GDN layers ``gdn`` (conv + [Hv, Dk, Dv]); PLE layers also ``ple_ids`` (the
previous ``ngram_size - 1`` ids, fp32) and ``ple_conv`` (the dilated conv's window
[hc * hidden, (K - 1) * ngram_size], model dtype), both replicated under TP; attention
layers the KV and the ``indexer`` rows [1, indexer_head_dim] per token (replicated).

Refused, named: ``hidden_act`` / ``output_gate_type`` other than silu, layer types other than
linear / indexed attention, an indexed layer without the ``indexer_*`` fields or with
``indexer_kv_heads`` != 1, ``indexer_budget`` not a multiple of ``indexer_compress_ratio``,
rotary dims wider than ``indexer_head_dim``, ``hc_count`` < 2, PLE on an attention layer or
without ``eos_token_id``, ``ple_embed_dim`` not a multiple of the n-gram heads, a rope_type
other than default. Qwen3.5's fields that Qwen4-Exp's config does not have
(``attn_output_gate``, ``decoder_sparse_step``, ...) are ignored, as transformers ignores
them. No MTP: ``mtp.*`` tensors are set aside unused, as transformers 5.24 ignores them, so
``spec.method: mtp`` is refused. The n-gram tables are whole on every TP rank (the released
ones are ~90 GiB: sharding them or keeping them on the host is not done). Not math:
``max_position_embeddings``, ``router_aux_loss_coef``, init and dropout fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.base import LINEAR_ATTENTION, HybridForCausalLM, default_rope
from workers.models.gated_deltanet import SplitGatedDeltaNet
from workers.models.layers import LayerContext, RotaryEmbedding
from workers.models.moe import unfuse_expert_tensors
from workers.models.qwen3_next import attention_dims, gdn_dims, head_dim, qwen_moe
from workers.models.qwen4_exp_layers import GatedResidual, IndexedAttention, IndexerDims, QsaIndexer
from workers.models.qwen4_exp_ple import PerLayerEmbedding, PleDims
from workers.models.wrapped_text import WrappedText
from workers.state_spec import StateRef, StateSites

INDEXED_ATTENTION = "indexed_attention"
_INDEXER_FIELDS = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
)


def layer_types(cfg: Any) -> list[str]:
    """``full_attention`` (the released configs' name) read as ``indexed_attention``."""
    return [INDEXED_ATTENTION if t == "full_attention" else t for t in cfg.layer_types]


def eos_id(cfg: Any) -> int | None:
    eos = cfg.eos_token_id
    return (eos[0] if eos else None) if isinstance(eos, list) else eos


def validate(cfg: Any) -> None:
    """ValueError naming the first field whose value is not served (module docstring)."""
    for field in ("hidden_act", "output_gate_type"):
        if (getattr(cfg, field, None) or "silu") != "silu":
            raise ValueError(f"{field}={getattr(cfg, field)!r} is not supported (only 'silu')")
    types = layer_types(cfg)
    unknown = sorted(set(types) - {LINEAR_ATTENTION, INDEXED_ATTENTION})
    if unknown or len(types) != cfg.num_hidden_layers:
        raise ValueError(
            f"layer_types={cfg.layer_types} is not supported: {cfg.num_hidden_layers} layers of "
            f"{LINEAR_ATTENTION!r} / {INDEXED_ATTENTION!r} expected"
        )
    if cfg.hc_count < 2:
        raise ValueError(f"hc_count={cfg.hc_count} is not supported (at least 2 streams)")
    if INDEXED_ATTENTION in types:
        for field in _INDEXER_FIELDS:
            if not getattr(cfg, field, None) or getattr(cfg, field) < 1:
                raise ValueError(f"{field}={getattr(cfg, field, None)!r}: indexed_attention layers need it positive")
        if cfg.indexer_kv_heads != 1:
            raise ValueError(f"indexer_kv_heads={cfg.indexer_kv_heads} is not supported (one key head)")
        if cfg.indexer_budget % cfg.indexer_compress_ratio:
            raise ValueError(
                f"indexer_budget={cfg.indexer_budget} is not a multiple of "
                f"indexer_compress_ratio={cfg.indexer_compress_ratio}"
            )
        if default_rope(cfg, head_dim(cfg)).rotary_dim > cfg.indexer_head_dim:
            raise ValueError(f"indexer_head_dim={cfg.indexer_head_dim} is narrower than the rotary dims")
    for layer_id in cfg.ple_layer_ids or []:
        if not 1 <= layer_id <= len(types) or types[layer_id - 1] != LINEAR_ATTENTION:
            raise ValueError(
                f"ple_layer_ids={cfg.ple_layer_ids}: {layer_id} is not a linear_attention layer (1-indexed)"
            )
    if cfg.ple_layer_ids:
        if eos_id(cfg) is None:
            raise ValueError("eos_token_id=None: PLE layers (ple_layer_ids) need it")
        heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
        if heads < 1 or cfg.ple_embed_dim % heads:
            raise ValueError(f"ple_embed_dim={cfg.ple_embed_dim} is not a multiple of the {heads} n-gram heads")


def ple_dims(cfg: Any) -> PleDims:
    return PleDims(
        hidden_size=cfg.hidden_size,
        streams=cfg.hc_count,
        embed_dim=cfg.ple_embed_dim or cfg.hidden_size,
        ngram_size=cfg.ngram_size,
        heads_per_ngram=cfg.heads_per_ngram,
        vocab_base=cfg.ngram_vocab_size_base,
        vocab_multiple=cfg.make_ngram_vocab_size_divisible_by,
        table_parts=cfg.split_ngram_parts,
        conv_kernel=cfg.ple_conv_kernel_size,
        eos=eos_id(cfg),
        eps=cfg.rms_norm_eps,
    )


def indexer_dims(cfg: Any) -> IndexerDims:
    return IndexerDims(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.indexer_n_heads,
        head_dim=cfg.indexer_head_dim,
        block_size=cfg.indexer_compress_ratio,
        top_blocks=cfg.indexer_budget // cfg.indexer_compress_ratio,
        eps=cfg.rms_norm_eps,
    )


class Qwen4ExpDecoderLayer(nn.Module):
    """``streams += ple(streams)``; ``streams = hc.around(streams, mixer)``; then the MoE alike."""

    def __init__(self, cfg: Any, kind: str, ple_index: int | None, dtype: torch.dtype, sites: StateSites) -> None:
        super().__init__()
        self.ple: PerLayerEmbedding | None = None
        self.ple_refs: tuple[StateRef, StateRef] | None = None
        if ple_index is not None:
            self.ple = PerLayerEmbedding(ple_dims(cfg), ple_index, dtype)
            self.ple_refs = (sites.add(self.ple.ple_embedding), sites.add(self.ple))
        if kind == LINEAR_ATTENTION:
            self.mixer_name, mixer = "linear_attn", SplitGatedDeltaNet(gdn_dims(cfg), dtype)
        else:
            indexer = QsaIndexer(indexer_dims(cfg), default_rope(cfg, head_dim(cfg)), dtype)
            self.mixer_name, mixer = "self_attn", IndexedAttention(attention_dims(cfg), indexer, dtype)
            mixer.indexer_ref = sites.add(indexer)
        self.add_module(self.mixer_name, mixer)
        self.ref = sites.add(mixer)
        self.mlp = qwen_moe(cfg, dtype, norm_topk_prob=bool(cfg.norm_topk_prob))
        hc = (cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps, dtype, True)
        self.attn_hyper_connection = GatedResidual(*hc)
        self.mlp_hyper_connection = GatedResidual(*hc)

    def forward(self, streams: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        if self.ple is not None:
            assert self.ple_refs is not None
            streams = streams + self.ple(streams, ctx, self.ple_refs)
        streams = self.attn_hyper_connection.around(streams, getattr(self, self.mixer_name), ctx, self.ref)
        return self.mlp_hyper_connection.around(streams, self.mlp)


class Qwen4ExpForCausalLM(HybridForCausalLM):
    final_norm_name = "hyper_connection_mixer"

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        validate(cfg)

    def _build_layers(self, cfg: Any, dtype: torch.dtype, sites: StateSites) -> tuple[list[nn.Module], nn.Module]:
        ple_ids = sorted(set(cfg.ple_layer_ids or []))
        layers = [
            Qwen4ExpDecoderLayer(cfg, kind, ple_ids.index(i + 1) if i + 1 in ple_ids else None, dtype, sites)
            for i, kind in enumerate(layer_types(cfg))
        ]
        mixer = GatedResidual(cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps, dtype, False)
        return layers, mixer

    def _build_rotary(self, cfg: Any) -> RotaryEmbedding | None:
        return default_rope(cfg, head_dim(cfg))

    def forward(self, batch: ForwardBatch, pools: DevicePools) -> torch.Tensor:
        hidden = self.model.embedding(batch.input_ids)
        assert self.rotary is not None
        ctx = LayerContext(batch, pools, self.rotary.tables(batch.positions, hidden.dtype), hidden)
        streams = hidden.repeat(1, self.config.hc_count)
        for layer in self.model.layers:
            streams = layer(streams, ctx)
        return self.model.final_norm(streams)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return unfuse_expert_tensors(weights)


class Qwen4ExpForConditionalGeneration(WrappedText, Qwen4ExpForCausalLM):
    """The language model under ``model.language_model.*``; ``model.visual.*`` skipped."""

    text_model_types = ("qwen4_exp_text",)
    text_renames = (("model.language_model.", "model."),)
    tower_prefixes = ("model.visual.",)
