"""Tiny Qwen3.5 / 3.6 checkpoints for the registry (``tiny_registry``): configs and layouts.

Four architectures, each saved by transformers' own class: ``qwen3_5`` (dense text,
``Qwen3_5ForCausalLM``), ``qwen3_5_moe`` (``Qwen3_5MoeForCausalLM``), and the released
vision-language form of each, ``qwen3_5_vl`` / ``qwen3_5_moe_vl``
(``...ForConditionalGeneration``: the language model under ``model.language_model.*``
next to a one-block vision tower ``model.visual.*``). ``rope_parameters`` carries
``mrope_section`` / ``mrope_interleaved`` as the released configs do.

``fuse_experts(out_dir)`` rewrites the per-expert tensors transformers saves into the fused
``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I] layout that released
Qwen3.5-MoE checkpoints may use (transformers loads both).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")

TEXT: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    head_dim=32,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
DENSE: dict[str, Any] = dict(TEXT, intermediate_size=128)
MOE: dict[str, Any] = dict(
    TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)
VISION: dict[str, Any] = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)


def vl_config(text: dict[str, Any]) -> dict[str, Any]:
    return {"text_config": text, "vision_config": VISION, "tie_word_embeddings": False}


def fuse_experts(out_dir: Path) -> None:
    """Per-expert tensors -> fused ``experts.gate_up_proj`` / ``experts.down_proj``, per file
    (the experts of one layer must sit in one file: a checkpoint saved in one shard)."""
    from safetensors.torch import load_file, save_file

    index_path = out_dir / "model.safetensors.index.json"
    if index_path.exists():
        raise ValueError(f"fuse_experts needs a checkpoint in one file; {out_dir} is sharded")
    path = out_dir / "model.safetensors"
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for key, t in load_file(str(path)).items():
        m = _EXPERT.match(key)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[key] = t
    for prefix, parts in groups.items():
        experts = range(1 + max(e for e, _ in parts))
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in experts])
    save_file(out, str(path), metadata={"format": "pt"})


def config_json(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "config.json").read_text())
