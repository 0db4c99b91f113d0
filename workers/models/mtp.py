"""Qwen3-Next's MTP (NEXTN) head, built from the checkpoint's ``mtp.*`` tensors.

Row t of an MTP batch combines the target's final-normed hidden state h_t with the
embedding of the next token x_{t+1} and predicts x_{t+2}:

    x = fc([pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])
    h' = norm(decoder_layer(x))             # one full-attention (MoE) layer, RoPE at t

``embed_tokens`` and ``lm_head`` are the target's. The layer keeps its own KV in the KV pool
layer ``kv_index`` (one past the target's attention layers), at the same page locations as
the target's tokens, so row t is stored at position t. Chained drafting feeds h' back in as
the "hidden" of the next row.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.base import HybridDecoderLayer
from workers.models.layers import Attention, DenseMLP, LayerContext, RMSNorm, linear
from workers.models.moe import MoeDims, SparseMoE
from workers.models.qwen3_next import attention_dims
from workers.models.weights import load_named_weights, module_targets
from workers.state_spec import ATTENTION, StateRef


def _ffn(cfg: Any, moe: bool, dtype: torch.dtype) -> nn.Module:
    if not moe:
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)
    dims = MoeDims(hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
                   num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, style="qwen",
                   norm_topk_prob=bool(cfg.norm_topk_prob),
                   shared_intermediate_size=cfg.shared_expert_intermediate_size)
    return SparseMoE(dims, dtype)


class Qwen3NextMTP(nn.Module):
    def __init__(self, target: nn.Module, kv_index: int) -> None:
        super().__init__()
        weights = target.mtp_weights
        if not weights:
            raise ValueError("spec.method 'mtp' needs a checkpoint with mtp.* tensors; this one has none")
        cfg, dtype = target.config, target.dtype
        device = target.model.embed_tokens.weight.device
        h = cfg.hidden_size

        def norm() -> RMSNorm:
            return RMSNorm(h, cfg.rms_norm_eps, dtype, zero_centered=True)

        with torch.device("meta"):
            self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = norm(), norm(), norm()
            self.fc = linear(2 * h, h, False, dtype)
            moe = any(name.startswith("mtp.layers.0.mlp.experts.") for name in weights)
            layer = HybridDecoderLayer("self_attn", Attention(attention_dims(cfg), dtype),
                                       StateRef(ATTENTION, kv_index), {"mlp": _ffn(cfg, moe, dtype)},
                                       norm(), norm())
            self.layers = nn.ModuleList([layer])
        self.to_empty(device=device)
        self.requires_grad_(False)
        self._load(weights)
        self._target = [target]          # not a submodule: its weights are shared, not owned

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        # load_named_weights sets mtp.* names aside, so match them without the prefix.
        targets = module_targets(self, "")
        extra = load_named_weights(targets, [(n.removeprefix("mtp."), t) for n, t in weights.items()])
        assert not extra

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    def forward(self, batch: ForwardBatch, hidden_prev: torch.Tensor, pools: DevicePools) -> torch.Tensor:
        """batch.input_ids = x_{t+1}; batch.positions = t; hidden_prev = h_t. -> h' [T, H]."""
        target = self.target
        emb = target.model.embed_tokens(batch.input_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb),
                               self.pre_fc_norm_hidden(hidden_prev.to(emb.dtype))], dim=-1))
        rope = target.rotary.tables(batch.positions, x.dtype) if target.rotary is not None else None
        x = self.layers[0](x, LayerContext(batch, pools, rope))
        return self.norm(x)
