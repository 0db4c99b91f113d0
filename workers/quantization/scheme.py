"""A checkpoint's ``quantization_config`` -> a ``QuantScheme``, or a ValueError naming the field.

Only FP8 E4M3 weights with dynamic (or, for ModelOpt, static per-tensor) activations are
accepted; any other method (GPTQ, AWQ, bitsandbytes, NVFP4, ...), format or option that would
change the numbers is refused rather than ignored.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

BLOCK, CHANNEL, TENSOR = "block", "channel", "tensor"
MODELOPT_FILE = "hf_quant_config.json"
_SUPPORTED = "fp8 (block-wise), modelopt (quant_algo FP8), compressed-tensors (FP8 channel/tensor weights)"


class QuantScheme(NamedTuple):
    """How a checkpoint stores its quantized tensors.

    ``scale_suffix``: a quantized tensor ``T``'s scale is ``T + scale_suffix``.
    ``unquantized``: the checkpoint's list of modules it left in high precision, matched
    with the ``match`` rule of its producer (``prefix``: transformers' boundary / suffix rule,
    ``glob``: ModelOpt's wildcards, ``ct``: compressed-tensors' exact names or ``re:``).
    ``static_inputs``: ``<module>.input_scale`` tensors are part of the format.
    """

    method: str
    granularity: str
    block: tuple[int, int] | None
    scale_suffix: str
    unquantized: tuple[str, ...]
    match: str
    static_inputs: bool
    source: str  # the config as read (canonical JSON): the fingerprint and the log name it

    def describe(self) -> str:
        size = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"{self.method}: FP8 e4m3 weights, {self.granularity}{size} scales"

    def leaves_unquantized(self, module: str) -> bool:
        return any(_matches(self.match, pattern, module) for pattern in self.unquantized)


def _matches(rule: str, pattern: str, module: str) -> bool:
    if rule == "ct":
        return re.match(pattern[3:], module) is not None if pattern.startswith("re:") else pattern == module
    if rule == "glob":
        return fnmatch.fnmatchcase(module, pattern) or module.startswith(pattern + ".")
    # transformers: from the start up to a module boundary (as a regex), or as a suffix
    return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None or module.endswith(pattern)


def _refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field}={value!r}: {why}")


def _names(cfg: dict[str, Any], field: str) -> tuple[str, ...]:
    value = cfg.get(field) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(field, value, "must be a list of module names")
    return tuple(value)


def _check_fields(cfg: dict[str, Any], known: set[str], method: str) -> None:
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise _refuse(unknown[0], cfg[unknown[0]], f"not a field hybridserve knows for quant_method {method!r}")


def _block_fp8(cfg: dict[str, Any], source: str) -> QuantScheme:
    _check_fields(
        cfg,
        {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert", "dequantize"}
        | {"scale_fmt", "expert_dtype", "modules_to_convert"},
        "fp8",
    )
    if cfg.get("modules_to_convert"):
        raise _refuse("modules_to_convert", cfg["modules_to_convert"], "FP8 embeddings are not supported")
    if cfg.get("expert_dtype", "fp8") != "fp8":
        raise _refuse("expert_dtype", cfg["expert_dtype"], "only FP8 experts are supported")
    if cfg.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", cfg["fmt"], "only FP8 e4m3 weights are supported")
    if cfg.get("scale_fmt", "float") != "float":
        raise _refuse("scale_fmt", cfg["scale_fmt"], "only float scales are supported")
    if cfg.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("activation_scheme", cfg["activation_scheme"], "block-wise FP8 needs dynamic activations")
    block = cfg.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse("weight_block_size", block, "expected two positive ints (per-tensor fp8 is not supported)")
    unquantized = _names(cfg, "modules_to_not_convert")
    return QuantScheme("fp8", BLOCK, (block[0], block[1]), "_scale_inv", unquantized, "prefix", False, source)


def _modelopt(cfg: dict[str, Any], source: str) -> QuantScheme:
    inner = cfg.get("quantization", cfg)  # hf_quant_config.json nests it; config.json may not
    if not isinstance(inner, dict):
        raise _refuse("quantization", inner, "must be an object")
    algo = inner.get("quant_algo")
    if algo != "FP8":
        raise _refuse("quant_algo", algo, "only ModelOpt's FP8 (per-tensor) is supported")
    if inner.get("kv_cache_quant_algo") not in (None, "NONE"):
        raise _refuse("kv_cache_quant_algo", inner["kv_cache_quant_algo"], "a quantized KV cache is not supported")
    unquantized = _names(inner, "exclude_modules")
    return QuantScheme("modelopt", TENSOR, None, "_scale", unquantized, "glob", True, source)


def _ct_weights(name: str, group: dict[str, Any]) -> str:
    """A compressed-tensors group's weight strategy, after refusing what is not FP8."""
    w = group.get("weights") or {}
    at = f"config_groups.{name}.weights"
    for field, want in (("num_bits", 8), ("type", "float"), ("symmetric", True), ("dynamic", False)):
        if w.get(field, want) != want:
            raise _refuse(f"{at}.{field}", w.get(field), f"only {want!r} is supported (FP8 weights)")
    if w.get("strategy") not in (CHANNEL, TENSOR):
        raise _refuse(f"{at}.strategy", w.get("strategy"), "only 'channel' and 'tensor' FP8 weights are supported")
    acts = group.get("input_activations")
    if acts is not None and acts.get("dynamic") is not True:
        raise _refuse(
            f"config_groups.{name}.input_activations.dynamic", acts.get("dynamic"), "static activations not supported"
        )
    if acts is not None and (acts.get("num_bits"), acts.get("type")) != (8, "float"):
        raise _refuse(f"config_groups.{name}.input_activations", acts, "only FP8 activations are supported")
    if group.get("output_activations"):
        raise _refuse(f"config_groups.{name}.output_activations", group["output_activations"], "not supported")
    return str(w["strategy"])


def _compressed_tensors(cfg: dict[str, Any], source: str) -> QuantScheme:
    if cfg.get("format") != "float-quantized":
        raise _refuse("format", cfg.get("format"), "only 'float-quantized' (FP8) is supported")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if cfg.get(field):
            raise _refuse(field, cfg[field], "not supported")
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("config_groups", groups, "expected at least one group")
    strategies = {_ct_weights(name, group) for name, group in groups.items()}
    if len(strategies) != 1:
        raise _refuse("config_groups", sorted(strategies), "groups with different weight strategies")
    unquantized = _names(cfg, "ignore")
    return QuantScheme("compressed-tensors", strategies.pop(), None, "_scale", unquantized, "ct", False, source)


def scheme_from_config(cfg: Any) -> QuantScheme | None:
    """The scheme of a ``quantization_config`` dict (None: not quantized)."""
    if not cfg:
        return None
    if not isinstance(cfg, dict):
        raise ValueError(f"quantization_config must be an object, got {cfg!r}")
    source = json.dumps(cfg, sort_keys=True)
    method = cfg.get("quant_method")
    if method == "fp8":
        return _block_fp8(cfg, source)
    if method == "modelopt" or (method is None and "producer" in cfg):
        return _modelopt(cfg, source)
    if method == "compressed-tensors":
        return _compressed_tensors(cfg, source)
    raise _refuse("quant_method", method, f"not supported; hybridserve loads {_SUPPORTED}")


def read_scheme(model_dir: Path, raw: dict[str, Any]) -> QuantScheme | None:
    """``config.json``'s ``quantization_config``, else ModelOpt's ``hf_quant_config.json``."""
    if raw.get("quantization_config"):
        return scheme_from_config(raw["quantization_config"])
    path = Path(model_dir) / MODELOPT_FILE
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object")
    return _modelopt(cfg, json.dumps(cfg, sort_keys=True))
