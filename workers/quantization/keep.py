"""Keeping an FP8 checkpoint's projections FP8 in memory (config ``fp8_weights``).

Every FP8 checkpoint tensor whose target is the whole weight of a ``kernels.dense.Linear``
(attention, the recurrent mixers' projections, dense MLPs and shared experts) is loaded as
stored, e4m3 with its scale, and the module multiplies through ``kernels.fp8``
(``Linear.forward``). The rest is dequantized at load as without the switch: fused or split
targets, the routed experts' stacked tensors and the MTP head's layers. Only the prescribed
activation quantization changes the numbers: dynamic per token (per 128-group for block
scales); ModelOpt's static ``input_scale`` is still not applied.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import dense
from kernels.fp8 import FP8
from workers.quantization.scheme import BLOCK, QuantScheme
from workers.quantization.stream import CheckpointPlan


def fp8_projections(model: nn.Module, plan: CheckpointPlan) -> dict[str, dense.Linear]:
    """Checkpoint names of FP8 weights that are a ``dense.Linear``'s whole weight -> the module."""
    owners = {id(m.weight): m for m in model.modules() if isinstance(m, dense.Linear)}
    found = {}
    for name, target in model.weight_targets().items():  # type: ignore[operator]
        if name not in plan.scales or len(target.parts) != 1:
            continue
        module = owners.get(id(target.parts[0][0]))
        if module is not None and tuple(module.weight.shape) == target.shape:
            found[name] = module
    return found


def make_fp8(module: dense.Linear, scale_shape: tuple[int, ...], scheme: QuantScheme) -> None:
    """``module`` holds an e4m3 weight of its shape and a fp32 ``weight_scale`` (filled by
    ``set_scales`` after loading)."""
    weight = module.weight
    module.weight = nn.Parameter(torch.empty(weight.shape, dtype=FP8, device=weight.device), requires_grad=False)
    module.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32, device=weight.device))
    module.fp8_block = scheme.block if scheme.granularity == BLOCK else None


def set_scales(kept: dict[str, dense.Linear], plan: CheckpointPlan, scales: dict[str, torch.Tensor]) -> None:
    for name, module in kept.items():
        module.weight_scale.copy_(scales[plan.scales[name]].float().reshape(module.weight_scale.shape))


def fp8_bytes(model: nn.Module) -> int:
    """Bytes the FP8 weights and their scales hold."""
    return sum(
        m.weight.numel() + m.weight_scale.numel() * 4
        for m in model.modules()
        if isinstance(m, dense.Linear) and m.weight.dtype == FP8
    )
