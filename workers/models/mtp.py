"""MTP (NEXTN) heads: the interface the drafter calls, and the Qwen hybrids' head.

``MtpHeadBase`` is what ``workers/spec/drafter.py`` drives: ``head(batch, hidden_prev,
pools, layer)`` -> [T, H] for MTP layer ``layer`` (rows: x_{s+1} at position s and the
hidden state they continue), ``num_layers`` (MTP layers = the drafter's chain length N),
``kv_index`` (the pool KV layer of the head's first attention block) and ``target`` (the
model whose embeddings and ``lm_head`` it shares). A family builds its modules on the meta
device, then ``_materialize`` allocates and loads them from ``target.mtp_weights``.

The Qwen hybrids' head (Qwen3-Next, Qwen3.5 / 3.6), ``MtpHead``, from ``mtp.*`` as released
(and as vLLM's / SGLang's Qwen MTP loaders read it): ``mtp.fc.weight`` [H, 2H];
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` (zero-centred
RMSNorms, shared by every layer); ``mtp.layers.{j}.*`` for j < ``mtp_num_hidden_layers``,
each a full-attention decoder layer of the family (MoE or dense feed-forward, as its tensors
say). ``embed_tokens`` and ``lm_head`` are the target's.

Row s of layer j takes a hidden state h and the next token x_{s+1}, and predicts x_{s+2}:

    x = fc([pre_fc_norm_embedding(embed(x_{s+1})), pre_fc_norm_hidden(h)])
    h'_j(s) = norm(layers[j](x))                # RoPE at position s

with h = the target's final-normed h_s for layer 0, and h = h'_{j-1}(s - 1) for j > 0 (the
chain of DeepSeek-V3's MTP modules; a one-layer head is layer 0 alone). Layer j keeps its
KV in pool layer ``kv_index + j`` at the same page locations as the target's tokens, so
row s is stored at position s. Drafting step i runs layer ``i % num_layers`` on the
previous step's output and draft (vLLM's rule for heads of several layers).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.base import HybridDecoderLayer
from workers.models.layers import LayerContext, RMSNorm, linear
from workers.models.weights import load_named_weights, module_targets
from workers.state_spec import ATTENTION, StateRef

# (its KV in the pool, is_moe) -> one full-attention decoder layer of the family
LayerFactory = Callable[[StateRef, bool], HybridDecoderLayer]
_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def mtp_layer_count(cfg: Any, weights: Mapping[str, torch.Tensor]) -> int:
    """``mtp_num_hidden_layers`` (or, absent, the layers the ``mtp.*`` tensors hold); 0 = none."""
    value = getattr(cfg, "mtp_num_hidden_layers", None)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"mtp_num_hidden_layers={value!r} must be a non-negative integer")
    if not weights:
        return 0
    return len(mtp_layer_ids(weights)) if value is None else value


def mtp_layer_ids(weights: Mapping[str, torch.Tensor]) -> list[int]:
    """The j of every ``mtp.layers.{j}.*`` tensor, sorted."""
    return sorted({int(m.group(1)) for name in weights if (m := _LAYER.match(name))})


class MtpHeadBase(nn.Module):
    """What the drafter drives (see the module docstring); subclasses define ``predict``.

    Built in two phases: the subclass's ``__init__`` calls ``super().__init__`` (which
    refuses a checkpoint without ``mtp.*`` tensors), creates its modules under
    ``torch.device("meta")``, then calls ``_materialize()``, which allocates them on the
    target's device and loads every ``mtp.*`` tensor strictly (a missing or unknown tensor
    is a ValueError naming it).
    """

    def __init__(self, target: nn.Module, kv_index: int, num_layers: int) -> None:
        super().__init__()
        if not target.mtp_weights:
            raise ValueError("spec.method 'mtp' needs a checkpoint with mtp.* tensors; this one has none")
        if getattr(target.config, "mtp_use_dedicated_embeddings", False):
            raise ValueError(
                "mtp_use_dedicated_embeddings=True (an MTP head with its own embedding table) is not supported"
            )
        self._target = [target]  # not a submodule: its weights are shared, not owned
        self._kv_index = kv_index
        self._num_layers = num_layers

    def _materialize(self) -> None:
        target = self.target
        self.to_empty(device=target.model.embedding.weight.device)
        self.requires_grad_(False)
        # load_named_weights sets mtp.* names aside, so match them without the prefix
        weights = [(n.removeprefix("mtp."), t) for n, t in target.mtp_weights.items()]
        extra = load_named_weights(module_targets(self, ""), weights)
        assert not extra

    @property
    def target(self) -> nn.Module:
        return self._target[0]

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def kv_index(self) -> int:
        """The pool KV layer of the first attention block (the others follow it)."""
        return self._kv_index

    def forward(
        self, batch: ForwardBatch, hidden_prev: torch.Tensor, pools: DevicePools, layer: int = 0
    ) -> torch.Tensor:
        """batch.input_ids = x_{s+1}; batch.positions = s; hidden_prev [T, H]. -> h' [T, H]."""
        return self.forward_tokens(batch.input_ids, batch, hidden_prev, pools, layer)

    def forward_tokens(
        self, tokens: torch.Tensor, batch: ForwardBatch, hidden_prev: torch.Tensor, pools: DevicePools, layer: int = 0
    ) -> torch.Tensor:
        """``forward`` with x_{s+1} given apart (``batch.input_ids`` unread): a compiled draft
        chain feeds each step the drafts of the step before."""
        target = self.target
        emb = target.model.embedding(tokens)
        rope = target.rotary.tables(batch.positions, emb.dtype) if target.rotary is not None else None
        return self.predict(layer, emb, hidden_prev.to(emb.dtype), LayerContext(batch, pools, rope))

    def predict(self, layer: int, emb: torch.Tensor, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """MTP layer ``layer`` on the embeddings of x_{s+1} [T, H] and hidden [T, H]."""
        raise NotImplementedError


class MtpHead(MtpHeadBase):
    """The Qwen hybrids' head (see the module docstring)."""

    def __init__(self, target: nn.Module, kv_index: int, num_layers: int, build_layer: LayerFactory) -> None:
        super().__init__(target, kv_index, num_layers)
        weights, cfg, dtype = target.mtp_weights, target.config, target.dtype
        if num_layers < 1:
            raise ValueError(
                f"mtp_num_hidden_layers={num_layers}: spec.method 'mtp' needs an MTP head of at least one layer"
            )
        found = mtp_layer_ids(weights)
        if found != list(range(num_layers)):
            raise ValueError(
                f"mtp_num_hidden_layers={num_layers}, but the checkpoint's mtp.* tensors hold layers {found}"
            )
        h = cfg.hidden_size

        def norm() -> RMSNorm:
            return RMSNorm(h, cfg.rms_norm_eps, dtype, zero_centered=True)

        with torch.device("meta"):
            self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.norm = norm(), norm(), norm()
            self.fc = linear(2 * h, h, False, dtype)
            self.layers = nn.ModuleList(
                [
                    build_layer(
                        StateRef(ATTENTION, kv_index + j),
                        any(n.startswith(f"mtp.layers.{j}.mlp.experts.") for n in weights),
                    )
                    for j in range(num_layers)
                ]
            )
        self._materialize()

    def predict(self, layer: int, emb: torch.Tensor, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[layer](x, ctx))
