"""A quantized checkpoint's tensors, dequantized as they stream.

``plan_checkpoint`` reads only the safetensors headers (names, dtypes, shapes) and pairs each
FP8 tensor with its scale, refusing a checkpoint that disagrees with its own config: an FP8
tensor without a scale, of a module the config leaves unquantized, or in e5m2; a scale of a
tensor that is not FP8, or of the wrong shape; static input scales where activations are
dynamic; KV-cache scales. ``checkpoint_weights`` then reads the scales (small) and streams
every other tensor, each FP8 one multiplied by its scale in fp32 and cast to the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from workers.quantization.scheme import BLOCK, CHANNEL, QuantScheme

FP8 = "F8_E4M3"
_SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_KV_SCALES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale")
INPUT_SCALE = ".input_scale"


class Header(NamedTuple):
    dtype: str  # safetensors' name: F8_E4M3, BF16, F32, ...
    shape: tuple[int, ...]
    path: Path


class CheckpointPlan(NamedTuple):
    """``scales``: FP8 tensor -> its scale's name; ``skipped``: scale tensors (not weights)."""

    headers: dict[str, Header]
    scales: dict[str, str]
    skipped: frozenset[str]


def read_headers(files: list[Path]) -> dict[str, Header]:
    from safetensors import safe_open

    headers: dict[str, Header] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                headers[name] = Header(piece.get_dtype(), tuple(piece.get_shape()), path)
    return headers


def expected_scale_shapes(scheme: QuantScheme, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The scale shapes the layout allows for a weight of ``shape`` ([..., out, in])."""
    lead, (rows, cols) = shape[:-2], shape[-2:]
    if scheme.granularity == BLOCK:
        assert scheme.block is not None
        return [(*lead, math.ceil(rows / scheme.block[0]), math.ceil(cols / scheme.block[1]))]
    if scheme.granularity == CHANNEL:
        return [(*lead, rows, 1)]
    return [(*lead,), (*lead, 1), (*lead, 1, 1)] if lead else [(), (1,)]


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def _check_fp8(scheme: QuantScheme, name: str, head: Header, headers: dict[str, Header]) -> str:
    """The scale name of the FP8 tensor ``name``, after checking the pair."""
    if scheme.leaves_unquantized(_module(name)):
        raise ValueError(
            f"tensor {name!r} is FP8 but the quantization_config leaves module {_module(name)!r} unquantized"
        )
    if len(head.shape) < 2:
        raise ValueError(f"FP8 tensor {name!r} has shape {head.shape}; only matrices (and stacks) are quantized")
    scale = name + scheme.scale_suffix
    found = headers.get(scale)
    if found is None:
        raise ValueError(f"FP8 tensor {name!r} has no scale {scale!r} in the checkpoint")
    if found.dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale {scale!r} is {found.dtype}; expected a float scale (F32, BF16, F16)")
    allowed = expected_scale_shapes(scheme, head.shape)
    if found.shape not in allowed:
        raise ValueError(
            f"scale {scale!r} has shape {found.shape}; {scheme.describe()} of {name!r} {head.shape} needs {allowed[0]}"
        )
    return scale


def _check_other(scheme: QuantScheme, name: str, headers: dict[str, Header], scales: dict[str, str]) -> bool:
    """Whether ``name`` (not FP8) is a scale or input scale to skip; refuses strays."""
    if name.endswith(_KV_SCALES):
        raise ValueError(f"tensor {name!r} is a KV-cache scale: a quantized KV cache is not supported")
    if name.endswith(INPUT_SCALE):
        weight = _module(name) + ".weight"
        if not scheme.static_inputs:
            raise ValueError(f"tensor {name!r} is a static input scale; {scheme.describe()} has dynamic activations")
        if weight not in scales:
            raise ValueError(f"input scale {name!r} belongs to {weight!r}, which is not an FP8 tensor")
        if math.prod(headers[name].shape) != 1:
            raise ValueError(f"input scale {name!r} has shape {headers[name].shape}; expected one value")
        return True
    base = name.removesuffix(scheme.scale_suffix)
    if base != name and base in headers:
        if base not in scales:
            raise ValueError(f"tensor {base!r} has a scale {name!r} but is stored as {headers[base].dtype}, not FP8")
        return True
    return False


def plan_checkpoint(scheme: QuantScheme | None, headers: dict[str, Header]) -> CheckpointPlan:
    if scheme is None:
        fp8 = sorted(n for n, h in headers.items() if h.dtype.startswith("F8"))
        if fp8:
            raise ValueError(f"tensor {fp8[0]!r} is {headers[fp8[0]].dtype} but config.json has no quantization_config")
        return CheckpointPlan(headers, {}, frozenset())
    scales: dict[str, str] = {}
    for name, head in headers.items():
        if head.dtype == FP8:
            scales[name] = _check_fp8(scheme, name, head, headers)
        elif head.dtype.startswith("F8"):
            raise ValueError(f"tensor {name!r} is {head.dtype}; quantization_config.fmt allows only e4m3 ({FP8})")
    skipped = frozenset(n for n, h in headers.items() if h.dtype != FP8 and _check_other(scheme, n, headers, scales))
    return CheckpointPlan(headers, scales, skipped)


def dequantize(scheme: QuantScheme, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``weight * scale``, the scale broadcast over its block, row or tensor."""
    w, s = weight.to(torch.float32), scale.to(torch.float32)
    if scheme.granularity == BLOCK:
        assert scheme.block is not None
        rows, cols = w.shape[-2:]
        s = s.repeat_interleave(scheme.block[0], dim=-2).repeat_interleave(scheme.block[1], dim=-1)
        s = s[..., :rows, :cols]
    elif scheme.granularity != CHANNEL:
        s = s.reshape(*w.shape[:-2], 1, 1)
    return w * s


def _read(headers: dict[str, Header], names: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in sorted({headers[n].path for n in names}):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            out.update((n, f.get_tensor(n)) for n in names if headers[n].path == path)
    return out


def read_scales(plan: CheckpointPlan) -> dict[str, torch.Tensor]:
    return _read(plan.headers, set(plan.scales.values()))


def checkpoint_weights(
    scheme: QuantScheme,
    plan: CheckpointPlan,
    files: list[Path],
    dtype: torch.dtype,
    keep: frozenset[str] = frozenset(),
    scales: dict[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` file by file: FP8 tensors dequantized to ``dtype`` (those in ``keep``
    as stored, e4m3), scales left out."""
    from safetensors import safe_open

    scales = read_scales(plan) if scales is None else scales
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in plan.skipped:
                    continue
                tensor = f.get_tensor(name)
                if name in plan.scales and name not in keep:
                    tensor = dequantize(scheme, tensor, scales[plan.scales[name]]).to(dtype)
                yield name, tensor
