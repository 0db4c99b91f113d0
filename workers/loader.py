"""Load an HF-format model directory: config.json + safetensors (single or sharded).

Never executes code from the checkpoint (no ``trust_remote_code``) and never unpickles
(tensors come only from ``*.safetensors``). Tensors are streamed file by file into the
model's ``load_weights``, which checks names and shapes strictly.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from workers.models import SUPPORTED_ARCHITECTURES, HybridForCausalLM, get_model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class LoadedModel(NamedTuple):
    model: HybridForCausalLM
    hf_config: Any


def read_raw_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json")
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def check_raw_config(raw: dict[str, Any]) -> str:
    """Reject what we cannot serve before transformers parses the config; -> architecture."""
    archs = raw.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"config.json must name exactly one architecture, got {archs}; "
                         f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    get_model_class(archs[0])       # ValueError listing the supported ones
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ValueError(f"quantized checkpoints are not supported (quant_method={method!r})")
    if raw.get("auto_map"):
        raise ValueError("config.json has auto_map (remote code); hybridserve never runs "
                         "checkpoint code")
    return archs[0]


def load_config(model_dir: str | Path) -> Any:
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    check_raw_config(read_raw_config(model_dir))
    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    elif (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    else:
        raise ValueError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"safetensors shards listed in the index are missing: {missing}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` from each file in turn (CPU tensors, checkpoint dtype)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(model_dir: str | Path, dtype: torch.dtype,
               device: torch.device | str) -> LoadedModel:
    model_dir = Path(model_dir)
    hf_config = load_config(model_dir)
    cls = get_model_class(hf_config.architectures[0])
    model = cls(hf_config, dtype, device)
    model.load_weights(iter_safetensors(safetensors_files(model_dir)))
    model.eval()
    return LoadedModel(model, hf_config)
