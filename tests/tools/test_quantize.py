"""``python -m tools.quantize``: each layout's config fields and tensors, the ignore globs, and
a dequantized reference that is the FP8 weights times their scales."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tools.quantize import main

LAYOUT_FIELDS = {
    "block": ("_scale_inv", "modules_to_not_convert", {"quant_method": "fp8", "weight_block_size": [16, 32]}),
    "modelopt": ("_scale", "exclude_modules", {"quant_method": "modelopt", "quant_algo": "FP8"}),
    "channel": ("_scale", "ignore", {"quant_method": "compressed-tensors", "format": "float-quantized"}),
}
Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize("layout", sorted(LAYOUT_FIELDS))
def test_cli_writes_the_layout(tiny_qwen_dir, tmp_path, layout):
    suffix, ignore_field, fields = LAYOUT_FIELDS[layout]
    fp8, ref = tmp_path / "fp8", tmp_path / "ref"
    ignore = ["lm_head", "*.gate", "*shared_expert_gate", "model.layers.0.*"]
    main(
        [
            str(tiny_qwen_dir),
            str(fp8),
            "--layout",
            layout,
            "--block",
            "16",
            "32",
            "--dequantized",
            str(ref),
            "--ignore",
            *ignore,
        ]
    )
    cfg = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert fields.items() <= cfg.items()
    assert "model.layers.0.mlp.down_proj" in cfg[ignore_field] and "lm_head" in cfg[ignore_field]
    assert (fp8 / "tokenizer.json").is_file() and "quantization_config" not in json.loads(
        (ref / "config.json").read_text()
    )
    tensors, plain, src = (load_file(str(d / "model.safetensors")) for d in (fp8, ref, tiny_qwen_dir))
    assert tensors[Q].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32  # ignored by glob
    assert "model.layers.0.mlp.down_proj.weight" + suffix not in tensors
    scale = tensors[Q + suffix]
    if layout == "block":
        scale = scale.repeat_interleave(16, 0).repeat_interleave(32, 1)
    assert torch.equal(plain[Q], tensors[Q].float() * scale)
    assert (plain[Q] - src[Q]).abs().max() <= src[Q].abs().max() / 8 and not torch.equal(plain[Q], src[Q])
    assert tensors.keys() - {Q + suffix for Q in tensors} >= plain.keys()
    if layout == "modelopt":
        assert json.loads((fp8 / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
