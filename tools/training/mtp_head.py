"""The Qwen3-Next MTP head as a trainable torch module, and its checkpoint tensors.

Semantics (what the serving engine implements): given the main model's final-normed hidden
state ``h_t`` (the output of ``model.norm``, the input of ``lm_head``) and the embedding
``e_{t+1}`` of the next token::

    x = fc(concat[pre_fc_norm_embedding(e_{t+1}), pre_fc_norm_hidden(h_t)])   # 2H -> H
    x = layers.0(x)        # one full-attention decoder layer with MoE, causal over the
                           # MTP positions, RoPE at position t + 1
    logits = lm_head(norm(x))                                                  # -> token t+2

(The serving engine, ``workers.models.mtp``, like vLLM, puts row t at RoPE position t
instead; the layer only attends among MTP rows and RoPE is relative, so a uniform shift
changes nothing.) Embeddings and ``lm_head`` are the main model's. Every norm is Qwen3-Next's zero-centred
RMSNorm (``1 + w``). Built from transformers' own Qwen3-Next layers, so the decoder layer is
bit-for-bit a ``full_attention`` layer of the main model.

``checkpoint_tensors()`` gives the ``mtp.*`` tensors under the names and shapes of the
released checkpoints (read by vLLM's ``Qwen3NextMTP`` and by our loader's ``mtp_weights``):
``mtp.fc.weight`` [H, 2H], ``mtp.pre_fc_norm_{embedding,hidden}.weight``, ``mtp.norm.weight``
[H] and ``mtp.layers.0.*`` named like ``model.layers.N.*`` of a full-attention MoE layer (per
expert ``experts.{e}.{gate,up,down}_proj.weight``, not transformers' fused in-memory layout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def mtp_layer_index(cfg: Any) -> int:
    """Index of a main-model full-attention MoE layer: the MTP layer takes its shape."""
    for i, kind in enumerate(cfg.layer_types):
        if (
            kind == "full_attention"
            and i not in (cfg.mlp_only_layers or [])
            and cfg.num_experts > 0
            and (i + 1) % cfg.decoder_sparse_step == 0
        ):
            return i
    raise ValueError("the MTP head needs a full-attention MoE layer in the main model")


class TrainableMtpHead(nn.Module):
    """``mtp.*`` of Qwen3-Next (one MTP layer), to train. Apart from the served head
    (``workers.models.mtp.MtpHead``: paged KV, our kernels, inference only) because training
    needs autograd through transformers' own layers, the ones the main model is trained with."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            Qwen3NextDecoderLayer,
            Qwen3NextRMSNorm,
            Qwen3NextRotaryEmbedding,
        )

        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3NextRMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3NextRMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(cfg, mtp_layer_index(cfg))])
        self.norm = Qwen3NextRMSNorm(h, eps=eps)
        self.rotary_emb = Qwen3NextRotaryEmbedding(config=cfg)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Qwen3-Next's init: norms at 0 (applied as 1 + w), matrices N(0, std)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """hidden, next_embeds [B, T, H] (h_t, e_{t+1}); position_ids [B, T] (= t + 1).

        Returns the ``mtp.norm`` output [B, T, H]; ``lm_head`` of it predicts token t + 2.
        """
        t = hidden.shape[1]
        mask = torch.full((t, t), float("-inf"), dtype=hidden.dtype, device=hidden.device).triu(1)
        return self.rows(hidden, next_embeds, position_ids, mask)

    def rows(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: Any = None,
    ) -> torch.Tensor:
        """``forward`` with the attention mask [T, S] (additive) given, S = keys in ``cache``
        plus these T rows; ``cache`` (an object with transformers' ``Cache.update(k, v,
        layer_idx)``) holds the keys/values of earlier rows, as a chained draft step sees them."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        pos = self.rotary_emb(x, position_ids)
        x = self.layers[0](
            x,
            position_embeddings=pos,
            attention_mask=mask.to(x.dtype)[None, None],
            position_ids=position_ids,
            cache=cache,
        )
        return self.norm(x)

    def checkpoint_tensors(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The ``mtp.*`` tensors in checkpoint layout (per-expert matrices split out)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self.state_dict().items():
            if name.startswith("rotary_emb."):
                continue
            t = t.detach()
            if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] = cat(gate, up)
                base = name[: -len("gate_up_proj")]
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                    out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
            elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
                base = name[: -len("down_proj")]
                for e in range(t.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = t[e]
            else:
                out[name] = t
        return {"mtp." + k: (v if dtype is None else v.to(dtype)).contiguous().clone() for k, v in sorted(out.items())}


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
