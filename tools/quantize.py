"""Quantize a bf16/fp32 HF checkpoint directory into one of the FP8 layouts hybridserve loads.

``python -m tools.quantize SRC DST --layout block|modelopt|channel [--ignore GLOB ...]
[--block R C] [--dequantized REF]``

- ``block``: ``quant_method: fp8``, e4m3 weights with a ``weight_scale_inv`` per R x C block
  (default 128 x 128), dynamic activations (the Qwen3-Next / Qwen3.5 -FP8 releases);
- ``modelopt``: ``quant_method: modelopt``, ``quant_algo: FP8``, a per-tensor
  ``weight_scale`` (``config.json`` and ``hf_quant_config.json``); no activation calibration
  is run, so no ``input_scale`` is written;
- ``channel``: compressed-tensors ``float-quantized``, a ``weight_scale`` [out, 1] per row,
  dynamic per-token activations.

Every linear weight (a matrix named ``*.weight``, a stacked expert tensor) is quantized
except embeddings, norms, convolutions and the modules matched by ``--ignore`` (globs over
module names; default: ``lm_head`` and the MoE routers, which vLLM keeps unquantized); the
modules left so are listed in the layout's own field. ``--dequantized REF`` also writes the
checkpoint of the dequantized weights in fp32: the model the quantized one must equal.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch

LAYOUTS = ("block", "modelopt", "channel")
DEFAULT_IGNORE = ("lm_head", "*.gate", "*shared_expert_gate", "*.router")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
_NOT_LINEAR = ("embed", "norm", "conv")
_STACKED = ("gate_up_proj", "down_proj", "up_proj")  # fused experts: [E, out, in], no ``.weight``
INDEX = "model.safetensors.index.json"


class Quantized(NamedTuple):
    weight: torch.Tensor  # float8_e4m3fn
    scale: torch.Tensor  # fp32: the layout's multiplier (block / row / tensor)
    dequantized: torch.Tensor  # fp32: weight * scale, what a loader must see


class QuantizeReport(NamedTuple):
    quantized: list[str]
    unquantized: list[str]  # linear modules left in high precision (the config's list)


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """A linear layer's weight, by name and shape (no model code is needed)."""
    if not tensor.is_floating_point() or any(word in name.lower() for word in _NOT_LINEAR):
        return False
    leaf = name.rpartition(".")[2]
    return (tensor.ndim == 2 and leaf == "weight") or (tensor.ndim == 3 and leaf in ("weight", *_STACKED))


def _cast(w: torch.Tensor, scale: torch.Tensor) -> Quantized:
    """``w / scale`` in e4m3 (``scale`` already broadcast to ``w``'s shape)."""
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Quantized(q, scale, q.to(torch.float32) * scale)


def _amax_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero block stays zero


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> Quantized:
    w = w.to(torch.float32)
    (rows, cols), (br, bc) = w.shape[-2:], block
    pad_r, pad_c = -rows % br, -cols % bc
    padded = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r))
    grid = padded.reshape(*w.shape[:-2], (rows + pad_r) // br, br, (cols + pad_c) // bc, bc)
    scale = _amax_scale(grid.abs().amax(dim=(-3, -1)))  # [..., R, C]
    full = scale[..., :, None, :, None].expand(grid.shape).reshape(padded.shape)[..., :rows, :cols]
    out = _cast(w, full)
    return Quantized(out.weight, scale, out.dequantized)


def quantize_rows(w: torch.Tensor) -> Quantized:
    w = w.to(torch.float32)
    scale = _amax_scale(w.abs().amax(dim=-1, keepdim=True))  # [..., out, 1]
    return _cast(w, scale)


def quantize_tensor(w: torch.Tensor) -> Quantized:
    w = w.to(torch.float32)
    scale = _amax_scale(w.abs().amax(dim=(-2, -1)))  # [] or [E]
    out = _cast(w, scale[..., None, None])
    return Quantized(out.weight, scale, out.dequantized)


def quantize_one(layout: str, w: torch.Tensor, block: tuple[int, int]) -> tuple[Quantized, str]:
    """-> the quantized tensor and its scale's suffix."""
    if layout == "block":
        return quantize_block(w, block), "_scale_inv"
    return (quantize_rows(w) if layout == "channel" else quantize_tensor(w)), "_scale"


def quantization_config(layout: str, block: tuple[int, int], unquantized: list[str]) -> dict[str, Any]:
    if layout == "block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": unquantized,
        }
    if layout == "modelopt":
        head = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None}
        return {**head, "exclude_modules": unquantized}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": unquantized,
    }


def _files(src: Path) -> list[str]:
    if (src / INDEX).is_file():
        return sorted(set(json.loads((src / INDEX).read_text())["weight_map"].values()))
    return ["model.safetensors"]


def _convert_file(path: Path, layout: str, block: tuple[int, int], ignore: tuple[str, ...], report: QuantizeReport):
    """-> (quantized tensors, dequantized fp32 tensors) of one safetensors file."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(path)).items():
        module = name.rpartition(".")[0]
        if not is_linear_weight(name, tensor) or any(fnmatch.fnmatchcase(module, g) for g in ignore):
            out[name] = ref[name] = tensor
            if is_linear_weight(name, tensor):
                report.unquantized.append(module)
            continue
        q, suffix = quantize_one(layout, tensor, block)
        out[name], out[name + suffix], ref[name] = q.weight, q.scale, q.dequantized
        report.quantized.append(name)
    return out, ref


def _write_dir(src: Path, dst: Path, tensors: dict[str, dict[str, torch.Tensor]], quant: dict[str, Any] | None):
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (INDEX, "config.json"):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant is not None:
        config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for fname, content in tensors.items():
        save_file(content, str(dst / fname), metadata={"format": "pt"})
    if (src / INDEX).is_file():
        weight_map = {name: fname for fname, content in tensors.items() for name in content}
        (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    layout: str,
    *,
    ignore: tuple[str, ...] = DEFAULT_IGNORE,
    block: tuple[int, int] = (128, 128),
    dequantized: str | Path | None = None,
) -> QuantizeReport:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    src, dst = Path(src), Path(dst)
    report = QuantizeReport([], [])
    converted = {f: _convert_file(src / f, layout, block, ignore, report) for f in _files(src)}
    config = quantization_config(layout, block, sorted(set(report.unquantized)))
    _write_dir(src, dst, {f: pair[0] for f, pair in converted.items()}, config)
    if layout == "modelopt":
        producer = {"name": "hybridserve tools.quantize", "version": "1"}
        modelopt = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": config["exclude_modules"]}
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": modelopt}))
    if dequantized is not None:
        _write_dir(src, Path(dequantized), {f: pair[1] for f, pair in converted.items()}, None)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--layout", required=True, choices=LAYOUTS)
    parser.add_argument("--ignore", nargs="*", default=list(DEFAULT_IGNORE), help="module-name globs left unquantized")
    parser.add_argument("--block", nargs=2, type=int, default=[128, 128], metavar=("ROWS", "COLS"))
    parser.add_argument("--dequantized", default=None, help="also write the dequantized fp32 checkpoint here")
    args = parser.parse_args(argv)
    block = (args.block[0], args.block[1])
    ignore = tuple(args.ignore)
    ref = args.dequantized
    report = quantize_checkpoint(args.src, args.dst, args.layout, ignore=ignore, block=block, dequantized=ref)
    print(f"wrote {args.dst}: {len(report.quantized)} tensors quantized, {len(report.unquantized)} linear modules kept")


if __name__ == "__main__":
    main()
