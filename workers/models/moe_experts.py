"""The routed experts of a top-k MoE as a loop over the experts that were chosen.

``reference_loop`` is the reference: the (token, choice) rows sorted by expert, each chosen
expert's MLP on its rows, the outputs weighted and added per token. It reads the per-expert
row counts on the host (``.tolist()``), so it computes only the chosen rows (T*k of them, as
transformers' expert loop does) where a static formulation computes every expert on every
token. ``expert_loop``, the eager path, runs the loop's C++ twin on CPU once
``kernels.native_ops`` loads (it is built on the first call): the twin is the same loop,
with a fused kernel for experts of few fp32 rows (a decode step's: faster, its sums in
another order), so eager and compiled steps keep computing the same bits.

Every form takes ``limit`` (Ling's clipped SwiGLU, 0 = off): a gated expert's inner
activation is then ``min(act(gate), limit) * clamp(up, -limit, limit)`` (``swiglu``).
``reference_loop`` also takes ``clip_input``: GLM-5.3-Flash clips the gate before the
activation, ``act(min(gate, limit)) * clamp(up, -limit, limit)`` (no native twin).

``hybridserve::moe_experts`` is the same loop as one opaque op for a compiled CPU step of a
batch too large for the static formulation to be the cheaper (``moe.static_is_cheaper``):
inductor cannot trace a data-dependent loop, but on CPU reading the counts is a read of host
memory (no device sync), so the op keeps the loop's arithmetic -- and its numerics, exactly
the eager path's -- inside a compiled graph. A CUDA graph cannot hold it: GPU steps keep the
static formulation (``SparseMoE._routed_static``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kernels import cpu_linear, dense, native_ops
from workers.models.layers import activation


def swiglu(fn: Callable[[Tensor], Tensor], gate: Tensor, up: Tensor, limit: float, clip_input: bool = False) -> Tensor:
    """``fn(gate) * up``; with ``limit`` > 0 clipped: ``min(fn(gate), limit) * clamp(up, -limit, limit)``
    (``clip_input``: ``fn(min(gate, limit)) * clamp(up, -limit, limit)``)."""
    if limit <= 0:
        return fn(gate) * up
    if clip_input:
        return fn(gate.clamp(max=limit)) * up.clamp(-limit, limit)
    return fn(gate).clamp(max=limit) * up.clamp(-limit, limit)


def expert_loop(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w_gate: Tensor | None,
    w_up: Tensor,
    w_down: Tensor,
    act: str,
    limit: float = 0.0,
) -> Tensor:
    """The eager routed experts: the native loop on CPU where it builds, else ``reference_loop``."""
    if x.device.type == "cpu" and (native_ops.loaded() or native_ops.load()):  # no lock once loaded
        on = dense.invariant()
        return torch.ops.hybridserve_native.moe_experts(x, weights, ids, w_gate, w_up, w_down, act, limit, on)
    if dense.invariant():
        raise RuntimeError(f"the batch-invariant mode needs the native expert loop: {native_ops.failure()}")
    return reference_loop(x, weights, ids, w_gate, w_up, w_down, act, limit)


def reference_loop(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w_gate: Tensor | None,
    w_up: Tensor,
    w_down: Tensor,
    act: str,
    limit: float = 0.0,
    clip_input: bool = False,
) -> Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]) -> [T, H]; experts are
    ``down(swiglu(act, gate(x), up(x), limit, clip_input))``, or ``down(act(up(x)))`` without a gate."""
    fn = activation(act)
    k = ids.shape[1]
    flat_ids = ids.reshape(-1)  # [T*k], row r = token r // k
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w_up.shape[0]).tolist()
    flat_weights = weights.reshape(-1)
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = order[start : start + n]
        start += n
        tokens = rows // k
        h = x[tokens]
        up = cpu_linear.linear(h, w_up[e])
        inner = fn(up) if w_gate is None else swiglu(fn, cpu_linear.linear(h, w_gate[e]), up, limit, clip_input)
        y = cpu_linear.linear(inner, w_down[e])
        # a token picks an expert at most once, so ``tokens`` has no repeats; index_add_
        # would be equal but is very slow on CPU for small inputs (torch 2.13)
        out[tokens] += y * flat_weights[rows, None]
    return out


@torch.library.custom_op("hybridserve::moe_experts", mutates_args=(), device_types="cpu")
def moe_experts(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w_gate: Tensor | None,
    w_up: Tensor,
    w_down: Tensor,
    act: str,
    limit: float = 0.0,
) -> Tensor:
    return reference_loop(x, weights, ids, w_gate, w_up, w_down, act, limit)


@moe_experts.register_fake
def _moe_experts_fake(
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    w_gate: Tensor | None,
    w_up: Tensor,
    w_down: Tensor,
    act: str,
    limit: float = 0.0,
) -> Tensor:
    return x.new_empty(x.shape[0], w_down.shape[1])


def expert_loop_op():
    """The loop as one opaque op for a compiled CPU step: its C++ twin
    ``hybridserve_native::moe_experts`` once ``kernels.native_ops`` loaded (no GIL, no
    interpreter inside the step), else the Python op."""
    return torch.ops.hybridserve_native.moe_experts if native_ops.loaded() else moe_experts
