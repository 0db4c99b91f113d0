"""Top-k mixture of experts with an optional gated shared expert.

Experts are stacked ``[E, ...]`` parameters (gate, up, down kept apart so they shard by
expert or by the intermediate dim). Two routing rules and two checkpoint layouts:

- ``style="qwen"`` (Qwen2/3-MoE, Qwen3-Next): softmax over all experts, top-k, optional
  renormalisation; checkpoint ``gate.weight``, ``experts.{e}.{gate,up,down}_proj.weight``,
  ``shared_expert.*``, ``shared_expert_gate.weight``.
- ``style="granite"`` (GraniteMoe*): top-k of the logits, softmax over those k; checkpoint
  ``router.layer.weight``, ``input_linear.weight`` [E, 2I, H] = cat(gate, up),
  ``output_linear.weight`` [E, H, I].

The expert loop (one host sync per layer for the per-expert token counts) is the CPU
reference; a fused MoE kernel can replace ``_routed`` later without touching the weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.layers import DenseMLP, linear, param
from workers.models.weights import WeightTarget, module_targets, split, whole


@dataclass(frozen=True)
class MoeDims:
    hidden_size: int
    intermediate_size: int          # per expert
    num_experts: int
    top_k: int
    style: str                      # "qwen" | "granite"
    norm_topk_prob: bool = True     # qwen only
    shared_intermediate_size: int = 0   # 0 = no shared expert (qwen style only)


class SparseMoE(nn.Module):
    def __init__(self, dims: MoeDims, dtype: torch.dtype) -> None:
        super().__init__()
        if dims.style not in ("qwen", "granite"):
            raise ValueError(f"unknown MoE style {dims.style!r}")
        if not 0 < dims.top_k <= dims.num_experts:
            raise ValueError(f"num_experts_per_tok={dims.top_k} must be in 1..{dims.num_experts}")
        self.dims = dims
        e, i, h = dims.num_experts, dims.intermediate_size, dims.hidden_size
        self.router_weight = param(e, h, dtype=dtype)
        self.w_gate = param(e, i, h, dtype=dtype)
        self.w_up = param(e, i, h, dtype=dtype)
        self.w_down = param(e, h, i, dtype=dtype)
        self.shared_expert: DenseMLP | None = None
        if dims.shared_intermediate_size:
            self.shared_expert = DenseMLP(h, dims.shared_intermediate_size, dtype)
            self.shared_expert_gate = linear(h, 1, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x, *self._route(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] in x.dtype, expert ids int64 [T, k])."""
        k = self.dims.top_k
        logits = F.linear(x, self.router_weight)
        if self.dims.style == "granite":
            top_logits, top_ids = logits.float().topk(k, dim=-1)
            return torch.softmax(top_logits, dim=-1).to(x.dtype), top_ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_probs, top_ids = probs.topk(k, dim=-1)
        if self.dims.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        return top_probs.to(x.dtype), top_ids

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        k = self.dims.top_k
        flat_ids = ids.reshape(-1)                               # [T*k], row r = token r // k
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.dims.num_experts).tolist()
        flat_weights = weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = order[start:start + n]
            start += n
            tokens = rows // k
            h = x[tokens]
            y = F.linear(F.silu(F.linear(h, self.w_gate[e])) * F.linear(h, self.w_up[e]),
                         self.w_down[e])
            # a token picks an expert at most once, so ``tokens`` has no repeats; index_add_
            # would be equal but is very slow on CPU for small inputs (torch 2.13)
            out[tokens] += y * flat_weights[rows, None]
        return out

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        if self.dims.style == "granite":
            return {f"{prefix}router.layer.weight": whole(self.router_weight),
                    f"{prefix}input_linear.weight": split(1, self.w_gate, self.w_up),
                    f"{prefix}output_linear.weight": whole(self.w_down)}
        targets = {f"{prefix}gate.weight": whole(self.router_weight)}
        for e in range(self.dims.num_experts):
            for name, stacked in (("gate_proj", self.w_gate), ("up_proj", self.w_up),
                                  ("down_proj", self.w_down)):
                targets[f"{prefix}experts.{e}.{name}.weight"] = whole(stacked[e])
        if self.shared_expert is not None:
            targets.update(module_targets(self.shared_expert, f"{prefix}shared_expert."))
            targets[f"{prefix}shared_expert_gate.weight"] = whole(self.shared_expert_gate.weight)
        return targets
