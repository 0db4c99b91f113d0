"""Top-k mixture of experts with an optional gated shared expert.

Experts are stacked ``[E, ...]`` parameters (gate, up, down kept apart so they shard by
expert or by the intermediate dim); an expert is ``down(act(gate(x)) * up(x))`` (clipped with
``swiglu_limit``, ``moe_experts.swiglu``), or ``down(act(up(x)))`` without a gate
(``gated=False``). Three routing rules and their layouts:

- ``style="qwen"`` (Qwen2/3-MoE, Qwen3-Next): softmax over all experts, top-k, optional
  renormalisation; checkpoint ``gate.weight``, ``experts.{e}.{gate,up,down}_proj.weight``,
  ``shared_expert.*``, ``shared_expert_gate.weight``.
- ``style="granite"`` (GraniteMoe*): top-k of the logits, softmax over those k; checkpoint
  ``router.layer.weight``, ``input_linear.weight`` [E, 2I, H] = cat(gate, up),
  ``output_linear.weight`` [E, H, I].
- ``style="sigmoid_grouped"`` (DeepSeek-V3 style, Nemotron-H, LFM2-MoE): fp32 sigmoid
  scores; the choice adds ``e_score_correction_bias`` (unless ``score_bias=False``), keeps the
  ``topk_groups`` best of ``num_groups`` expert groups (a group scores the sum of its top
  two), then the top-k; the weights are the chosen *uncorrected* scores, optionally
  renormalised (``sum + norm_eps``), times ``routed_scaling_factor``; checkpoint
  ``gate.weight`` (kept fp32), ``gate.e_score_correction_bias``,
  ``experts.{e}.{gate,up,down}_proj.weight``.

Qwen3.5-MoE checkpoints may also ship the experts fused, as transformers holds them:
``experts.gate_up_proj`` [E, 2I, H] = cat(gate, up) per expert and ``experts.down_proj``
[E, H, I]; ``unfuse_expert_tensors`` renames those to the per-expert layout (views).

The expert loop (``moe_experts.expert_loop``: one host read per layer for the per-expert
row counts) is the reference and the eager path. A step a CUDA graph captures (or one
checked under ``kernels.static.static_formulation``) cannot read the counts, so it takes a
static formulation of the same sums; a compiled CPU step takes it too where it is the
cheaper (``loop_op_is_cheaper``), else the loop as one opaque op (``hybridserve::moe_experts``:
on CPU the counts are host memory; its C++ twin ``hybridserve_native::moe_experts`` once
``kernels.native_ops`` loaded, at every batch size in fp32). The static formulation:
each (token, choice) row through its expert's gathered weights when there are fewer rows
than experts, else every expert on every token weighted by a dense ``[T, E]`` combine
matrix (zeros where not chosen).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kernels import dense, native_ops
from kernels.static import tracing
from workers.models.layers import DenseMLP, activation, linear, param
from workers.models.moe_experts import expert_loop, expert_loop_op, reference_loop, swiglu
from workers.models.weights import WeightTarget, module_targets, split, whole

STYLES = ("qwen", "granite", "sigmoid_grouped")


@dataclass(frozen=True)
class MoeDims:
    hidden_size: int  # the experts' input width (Nemotron-H: moe_latent_size)
    intermediate_size: int  # per expert
    num_experts: int
    top_k: int
    style: str  # one of STYLES
    norm_topk_prob: bool = True  # qwen, sigmoid_grouped
    shared_intermediate_size: int = 0  # 0 = no shared expert (qwen style only)
    gated: bool = True
    act: str = "silu"
    router_size: int | None = None  # the router's input width (default hidden_size)
    num_groups: int = 1  # sigmoid_grouped: expert groups (n_group) ...
    topk_groups: int = 1  # ... of which each token keeps this many (topk_group)
    routed_scaling_factor: float = 1.0
    score_bias: bool = True  # sigmoid_grouped: the choice adds a correction bias
    norm_eps: float = 1e-20  # sigmoid_grouped: renormalisation sum + eps (LFM2-MoE 1e-6)
    swiglu_limit: float = 0.0  # > 0: Ling's clipped SwiGLU (``moe_experts.swiglu``)
    swiglu_clip_input: bool = False  # GLM-5.3-Flash: the limit clips the gate before act

    def validate(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"unknown MoE style {self.style!r}")
        if self.swiglu_limit < 0 or (self.swiglu_limit > 0 and not self.gated):
            raise ValueError(f"swiglu_limit={self.swiglu_limit} needs gated experts and a limit >= 0 (0 = off)")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..{self.num_experts}")
        if self.style == "sigmoid_grouped":
            g = self.num_groups
            if g < 1 or self.num_experts % g or self.num_experts // g < 2:
                raise ValueError(
                    f"n_group={g} must divide n_routed_experts={self.num_experts} into groups of at least 2 experts"
                )
            if not 0 < self.topk_groups <= g:
                raise ValueError(f"topk_group={self.topk_groups} must be in 1..n_group={g}")
            if self.top_k > self.topk_groups * (self.num_experts // g):
                raise ValueError(
                    f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group={self.topk_groups} groups"
                )


# A compiled CPU step's choice between the static formulation and the expert loop op. The
# loop pays a fixed cost per chosen expert (slicing, three small GEMMs, the scatter) on top
# of its T*k rows; the dense form computes T*E rows in two batched GEMMs, the gathered one
# reads T*k experts' weights. Measured (BENCHMARKS.md): gathered beats the loop at every
# T*k < E, dense beats it while T*E <= 32*k.
DENSE_ROWS_PER_CHOICE = 32


def static_is_cheaper(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether a compiled CPU step takes ``_routed_static`` over the loop op (see above)."""
    return num_tokens * top_k < num_experts or num_tokens * num_experts <= DENSE_ROWS_PER_CHOICE * top_k


def loop_op_is_cheaper(x: torch.Tensor, dims: MoeDims) -> bool:
    """Whether a compiled CPU step takes the loop op over ``_routed_static``: at every size
    where the native loop's fused few-rows experts apply (fp32; the static formulation is
    slower at a decode's few tokens), else beyond ``static_is_cheaper``."""
    if native_ops.loaded() and x.dtype == torch.float32:
        return True
    return not static_is_cheaper(x.shape[0], dims.num_experts, dims.top_k)


class SparseMoE(nn.Module):
    def __init__(self, dims: MoeDims, dtype: torch.dtype) -> None:
        super().__init__()
        dims.validate()
        self.dims = dims
        e, i, h = dims.num_experts, dims.intermediate_size, dims.hidden_size
        grouped = dims.style == "sigmoid_grouped"
        # The sigmoid router is kept in fp32 (as transformers keeps gate.weight).
        self.router_weight = param(e, dims.router_size or h, dtype=torch.float32 if grouped else dtype)
        self.score_bias = param(e, dtype=torch.float32) if grouped and dims.score_bias else None
        self.w_gate = param(e, i, h, dtype=dtype) if dims.gated else None
        self.w_up = param(e, i, h, dtype=dtype)
        self.w_down = param(e, h, i, dtype=dtype)
        self.act = activation(dims.act)
        self.shared_expert: DenseMLP | None = None
        if dims.shared_intermediate_size:
            self.shared_expert = DenseMLP(h, dims.shared_intermediate_size, dtype)
            self.shared_expert_gate = linear(h, 1, False, dtype)

    def forward(self, x: torch.Tensor, expert_input: torch.Tensor | None = None) -> torch.Tensor:
        """Route on ``x``; the experts read ``expert_input`` (default ``x``; Nemotron-H's latent)."""
        h = x if expert_input is None else expert_input
        out = self._routed(h, *self._route(x))
        if self.shared_expert is not None:
            # A [T, 1] gate is one flat run: padded, its scalar tail cannot depend on T.
            gate = dense.pointwise(torch.sigmoid, self.shared_expert_gate(x))
            out = torch.addcmul(out, gate, self.shared_expert(x))
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (weights [T, k] in x.dtype, expert ids int64 [T, k])."""
        k = self.dims.top_k
        if self.dims.style == "sigmoid_grouped":
            return self._route_sigmoid_grouped(x)
        logits = dense.plain_linear(x, self.router_weight)
        if self.dims.style == "granite":
            top_logits, top_ids = logits.float().topk(k, dim=-1)
            return torch.softmax(top_logits, dim=-1).to(x.dtype), top_ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_probs, top_ids = probs.topk(k, dim=-1)
        if self.dims.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        return top_probs.to(x.dtype), top_ids

    def _route_sigmoid_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dims
        scores = dense.pointwise(torch.sigmoid, dense.plain_linear(x.float(), self.router_weight.float()))  # [T, E]
        choice = scores if self.score_bias is None else scores + self.score_bias
        per_group = d.num_experts // d.num_groups
        grouped = choice.view(-1, d.num_groups, per_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(d.topk_groups, dim=-1, sorted=False)[1], True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        top_ids = choice.topk(d.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, top_ids)
        if d.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + d.norm_eps)
        return (weights * d.routed_scaling_factor).to(x.dtype), top_ids

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        d = self.dims
        if d.swiglu_clip_input:  # the native loop clips Ling's way only
            if dense.invariant():
                raise RuntimeError("the batch-invariant mode needs the native expert loop, which has no input clip")
            if tracing():
                return self._routed_static(x, weights, ids)
            return reference_loop(x, weights, ids, self.w_gate, self.w_up, self.w_down, d.act, d.swiglu_limit, True)
        if not tracing():
            return expert_loop(x, weights, ids, self.w_gate, self.w_up, self.w_down, d.act, d.swiglu_limit)
        if x.device.type == "cpu" and torch.compiler.is_compiling() and loop_op_is_cheaper(x, d):
            return expert_loop_op()(x, weights, ids, self.w_gate, self.w_up, self.w_down, d.act, d.swiglu_limit)
        return self._routed_static(x, weights, ids)

    def _expert(
        self,
        h: torch.Tensor,
        up_w: torch.Tensor,
        gate_w: torch.Tensor | None,
        down_w: torch.Tensor,
        spec_in: str,
        spec_out: str,
    ) -> torch.Tensor:
        """Expert MLPs batched by einsum: ``spec_in`` for gate / up, ``spec_out`` for down."""
        up = torch.einsum(spec_in, h, up_w)
        if gate_w is None:
            inner = self.act(up)
        else:
            d = self.dims
            inner = swiglu(self.act, torch.einsum(spec_in, h, gate_w), up, d.swiglu_limit, d.swiglu_clip_input)
        return torch.einsum(spec_out, inner, down_w)

    def _routed_static(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``_routed`` without a host read (see the module docstring); shapes decide the form."""
        num_tokens, k = ids.shape
        ids, order = ids.sort(dim=-1)  # the loop's order: experts ascending
        weights = weights.gather(1, order)
        if num_tokens * k < self.dims.num_experts:  # gathered: read T*k experts
            flat = ids.reshape(-1)
            h = x.repeat_interleave(k, dim=0)  # [T*k, H], row r = token r // k
            gate = None if self.w_gate is None else self.w_gate[flat]
            y = self._expert(h, self.w_up[flat], gate, self.w_down[flat], "rh,rih->ri", "ri,rhi->rh")  # [T*k, H]
            return (y * weights.reshape(-1, 1)).view(num_tokens, k, -1).sum(dim=1)
        combine = torch.zeros(num_tokens, self.dims.num_experts, dtype=weights.dtype, device=x.device).scatter(
            1, ids, weights
        )  # [T, E]
        y = self._expert(x, self.w_up, self.w_gate, self.w_down, "th,eih->eti", "eti,ehi->eth")  # [E, T, H]
        return (y * combine.t()[:, :, None]).sum(dim=0)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        if self.dims.style == "granite":
            assert self.w_gate is not None
            return {
                f"{prefix}router.layer.weight": whole(self.router_weight),
                f"{prefix}input_linear.weight": split(1, self.w_gate, self.w_up),
                f"{prefix}output_linear.weight": whole(self.w_down),
            }
        targets = {f"{prefix}gate.weight": whole(self.router_weight)}
        if self.score_bias is not None:
            targets[f"{prefix}gate.e_score_correction_bias"] = whole(self.score_bias)
        for e in range(self.dims.num_experts):
            for name, stacked in (("gate_proj", self.w_gate), ("up_proj", self.w_up), ("down_proj", self.w_down)):
                if stacked is not None:
                    targets[f"{prefix}experts.{e}.{name}.weight"] = whole(stacked[e])
        if self.shared_expert is not None:
            targets.update(module_targets(self.shared_expert, f"{prefix}shared_expert."))
            targets[f"{prefix}shared_expert_gate.weight"] = whole(self.shared_expert_gate.weight)
        return targets


_FUSED_GATE_UP = ".experts.gate_up_proj"
_FUSED_DOWN = ".experts.down_proj"


def unfuse_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused expert tensors -> ``experts.{e}.{gate,up,down}_proj.weight`` views; others as is."""
    for name, tensor in weights:
        if name.endswith(_FUSED_GATE_UP):
            if tensor.dim() != 3 or tensor.shape[1] % 2:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}; expected "
                    "[num_experts, 2 * moe_intermediate_size, hidden_size]"
                )
            prefix = name[: -len("gate_up_proj")]
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", gate[e]
                yield f"{prefix}{e}.up_proj.weight", up[e]
        elif name.endswith(_FUSED_DOWN):
            if tensor.dim() != 3:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}; expected "
                    "[num_experts, hidden_size, moe_intermediate_size]"
                )
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
