"""Load an HF-format model directory: config.json + safetensors (single or sharded).

Untrusted checkpoints: nothing in the directory is ever imported or unpickled.

- ``config.json`` with ``auto_map`` (custom model code) is *refused* with a ValueError:
  the model class always comes from our registry, so a checkpoint that asks for its own
  code is one we cannot claim to serve faithfully.
- ``tokenizer_config.json`` with ``auto_map`` is *ignored* when its ``tokenizer_class`` is
  one transformers ships (the tokenizer is then fully described by data files) and
  refused otherwise; ``load_tokenizer`` always passes ``trust_remote_code=False``, so
  transformers neither imports the custom module nor prompts on stdin.
- Tensors come only from ``*.safetensors`` (an index may list nothing else). A directory
  whose only weights are pickle files (``pytorch_model.bin``, ``*.pt``, ...) is refused
  with a ValueError naming them; pickle files beside safetensors are never opened.

Tensors are streamed file by file into the model's ``load_weights``, which checks names
and shapes strictly. An FP8 checkpoint (``workers/quantization``) streams its weights
dequantized to the compute dtype; any other ``quantization_config`` is refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from workers.models import SUPPORTED_ARCHITECTURES, HybridForCausalLM, get_model_class
from workers.quantization import QuantScheme, checkpoint_weights, plan_checkpoint, read_scheme, scheme_from_config
from workers.quantization.keep import fp8_projections, make_fp8, set_scales
from workers.quantization.stream import CheckpointPlan, read_headers, read_scales

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Weight formats that are pickles (loading one may run arbitrary code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class LoadedModel(NamedTuple):
    model: HybridForCausalLM
    hf_config: Any  # the served language model's config (a VL checkpoint's text_config)


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
        raise ValueError(
            f"config.json must name exactly one architecture, got {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    get_model_class(archs[0])  # ValueError listing the supported ones
    scheme_from_config(raw.get("quantization_config"))  # ValueError naming what is not supported
    if raw.get("auto_map"):
        raise ValueError(
            f"config.json has auto_map {raw['auto_map']!r} (remote code); hybridserve never runs checkpoint code"
        )
    return archs[0]


def load_config(model_dir: str | Path) -> Any:
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    check_raw_config(read_raw_config(model_dir))
    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)


def _indexed_shards(model_dir: Path, index: Path) -> list[Path]:
    """The shard files an index names: safetensors files inside ``model_dir`` only."""
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map")
    names = sorted(set(map(str, weight_map.values())))
    bad = [n for n in names if not n.endswith(".safetensors") or Path(n).name != n]
    if bad:
        raise ValueError(
            f"{index} lists shards {bad[:5]} that are not *.safetensors files in "
            f"{model_dir}; hybridserve loads nothing else (pickle is never loaded)"
        )
    return [model_dir / name for name in names]


def pickle_weight_files(model_dir: Path) -> list[str]:
    """Names of pickle-format weight files in ``model_dir`` (never opened)."""
    return sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.name.endswith(PICKLE_SUFFIXES))


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        files = _indexed_shards(model_dir, index)
    elif (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    else:
        pickles = pickle_weight_files(model_dir)
        if pickles:
            raise ValueError(
                f"{model_dir} has only pickle weights ({', '.join(pickles)}); "
                "pickle is not loaded (unpickling can run arbitrary code): "
                f"convert the checkpoint to {SINGLE_FILE}"
            )
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


def check_tokenizer_config(model_dir: Path) -> None:
    """Refuse a tokenizer that exists only as checkpoint code (see the module docstring)."""
    path = model_dir / TOKENIZER_CONFIG
    if not path.is_file():
        return
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict) or not raw.get("auto_map"):
        return
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    name = raw.get("tokenizer_class")
    cls = tokenizer_class_from_name(name) if isinstance(name, str) and name else None
    if cls is None or not cls.__module__.startswith("transformers."):
        raise ValueError(
            f"{path} has auto_map {raw['auto_map']!r} and tokenizer_class {name!r}, "
            "which transformers does not ship: the tokenizer needs checkpoint code, "
            "and hybridserve never runs checkpoint code"
        )


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's tokenizer, from data files only (``trust_remote_code=False``).

    Raises ValueError for a tokenizer that needs checkpoint code; an ``auto_map`` next to
    a tokenizer class transformers ships is ignored.
    """
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    check_tokenizer_config(model_dir)
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)


class WeightBytes(NamedTuple):
    """What loading cost: ``resident`` bytes of parameters in the compute dtype, from
    ``checkpoint`` bytes of safetensors (FP8 and scales, for a quantized checkpoint)."""

    resident: int
    checkpoint: int


def weight_bytes(model: torch.nn.Module, files: list[Path]) -> WeightBytes:
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}  # tied ones once
    return WeightBytes(sum(params.values()), sum(f.stat().st_size for f in files))


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str, fp8_weights: bool = False
) -> LoadedModel:
    """``fp8_weights``: an FP8 checkpoint's projections stay FP8 (``workers/quantization/keep.py``)."""
    model_dir = Path(model_dir)
    hf_config = load_config(model_dir)
    scheme = read_scheme(model_dir, read_raw_config(model_dir))
    if fp8_weights and scheme is None:
        raise ValueError(f"fp8_weights: true needs an FP8 checkpoint; {model_dir.name} has no quantization_config")
    files = safetensors_files(model_dir)
    plan = plan_checkpoint(scheme, read_headers(files))  # refuses before anything is built
    cls = get_model_class(hf_config.architectures[0])
    model = cls(hf_config, dtype, device)
    if scheme is None:
        model.load_weights(iter_safetensors(files))
    else:
        _load_quantized(model, scheme, plan, files, dtype, fp8_weights)
    model.eval()
    logger.info("%s", describe_weights(model_dir, scheme, dtype, weight_bytes(model, files), fp8_weights))
    return LoadedModel(model, model.config)


def _load_quantized(
    model: torch.nn.Module, scheme: QuantScheme, plan: CheckpointPlan, files: list[Path], dtype: torch.dtype, keep: bool
) -> None:
    scales = read_scales(plan)
    kept = fp8_projections(model, plan) if keep else {}
    for name, module in kept.items():
        make_fp8(module, tuple(plan.headers[plan.scales[name]].shape), scheme)
    model.load_weights(checkpoint_weights(scheme, plan, files, dtype, frozenset(kept), scales))  # type: ignore[operator]
    set_scales(kept, plan, scales)


def describe_weights(
    model_dir: Path, scheme: QuantScheme | None, dtype: torch.dtype, size: WeightBytes, fp8_weights: bool = False
) -> str:
    """The startup line about the weights: bytes held, bytes read, and how."""
    if scheme is None:
        how = "plain"
    elif fp8_weights:
        how = f"{scheme.describe()}, projections kept FP8 (kernels/fp8), the rest dequantized at load"
    else:
        how = f"{scheme.describe()}, dequantized at load (fp8_weights: false)"
    return (
        f"weights of {model_dir.name}: {size.resident} bytes resident in {str(dtype).removeprefix('torch.')} "
        f"from {size.checkpoint} checkpoint bytes ({how})"
    )


class ImageSupport(NamedTuple):
    """What a checkpoint does with images: ``vl_checkpoint`` has a vision tower beside
    its language model; ``serves_images`` is whether hybridserve runs that tower."""

    vl_checkpoint: bool
    serves_images: bool


def image_support(model_dir: str | Path) -> ImageSupport:
    """Read from config.json alone (no weights), e.g. for an HTTP layer refusing image parts."""
    cls = get_model_class(check_raw_config(read_raw_config(Path(model_dir))))
    return ImageSupport(cls.is_vl_checkpoint, cls.serves_images)
