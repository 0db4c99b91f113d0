"""``workers/quantization``: what a ``quantization_config`` may say, what the tensors must be.

Every method and option that is not loaded is refused with a ValueError naming the field; a
checkpoint whose tensors disagree with its config (an FP8 tensor without a scale or in a
module the config leaves unquantized, a scale of the wrong shape, an input scale where
activations are dynamic, a KV-cache scale, FP8 without any config) is refused before the
model is built. What a checkpoint leaves unquantized loads bit for bit; ModelOpt's static
``input_scale`` is read and checked, the activations staying in the compute dtype. The
model fingerprint and the startup log name the quantization.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.quantize import quantize_block, quantize_checkpoint
from workers.loader import load_model
from workers.quantization import scheme_from_config
from workers.quantization.stream import dequantize
from workers.tiers.payload import model_fingerprint

BLOCK_CFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
CT_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
CT_ACTS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}


def ct(weights=None, acts=CT_ACTS, **top):
    group = {"targets": ["Linear"], "weights": {**CT_WEIGHTS, **(weights or {})}, "input_activations": acts}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": group}, **top}


REFUSED = [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method='gptq'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
    ({"quant_method": "mxfp4"}, "quant_method='mxfp4'"),
    ({"quant_method": "something-new"}, "quant_method='something-new'"),
    ({**BLOCK_CFG, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**BLOCK_CFG, "activation_scheme": "static"}, "activation_scheme='static'"),
    ({**BLOCK_CFG, "weight_block_size": None}, "weight_block_size=None"),
    ({**BLOCK_CFG, "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({**BLOCK_CFG, "ignored_layers": []}, "ignored_layers=[]"),
    ({**BLOCK_CFG, "expert_dtype": "fp4"}, "expert_dtype='fp4'"),
    ({**BLOCK_CFG, "modules_to_convert": ["embed_tokens"]}, "modules_to_convert=['embed_tokens']"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo='NVFP4'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, "kv_cache_quant_algo='FP8'"),
    (ct(weights={"num_bits": 4, "type": "int"}), "config_groups.g.weights.num_bits=4"),
    (ct(weights={"type": "int"}), "config_groups.g.weights.type='int'"),
    (ct(weights={"symmetric": False}), "config_groups.g.weights.symmetric=False"),
    (ct(weights={"strategy": "group", "group_size": 128}), "config_groups.g.weights.strategy='group'"),
    (ct(acts={**CT_ACTS, "dynamic": False}), "config_groups.g.input_activations.dynamic=False"),
    (ct(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme="),
    ({**ct(), "format": "pack-quantized"}, "format='pack-quantized'"),
]


@pytest.mark.parametrize("cfg,field", REFUSED, ids=[f for _, f in REFUSED])
def test_unsupported_quantization_is_refused_naming_the_field(cfg, field):
    with pytest.raises(ValueError, match="quantization_config") as err:
        scheme_from_config(cfg)
    assert field in str(err.value)


def test_supported_configs_parse():
    assert scheme_from_config(BLOCK_CFG).block == (128, 128)
    saved = {"modules_to_convert": None, "dequantize": False, "scale_fmt": "float", "expert_dtype": "fp8"}
    assert scheme_from_config({**BLOCK_CFG, **saved}).block == (128, 128)  # as transformers writes it
    assert scheme_from_config(ct(acts=None)).granularity == "channel"  # weight-only W8A16
    nested = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
    assert scheme_from_config(nested).leaves_unquantized("lm_head")


def test_unquantized_module_rules():
    block = scheme_from_config({**BLOCK_CFG, "modules_to_not_convert": ["model.layers.1.mlp.gate", "lm_head"]})
    assert block.leaves_unquantized("model.layers.1.mlp.gate")
    assert not block.leaves_unquantized("model.layers.1.mlp.gate_proj")
    assert not block.leaves_unquantized("model.layers.11.mlp.gate")
    glob = scheme_from_config({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["*mixer.gate"]})
    assert glob.leaves_unquantized("backbone.layers.1.mixer.gate")
    assert not glob.leaves_unquantized("backbone.layers.1.mixer.gate_proj")
    ct_rules = scheme_from_config(ct(ignore=["lm_head", "re:.*mlp\\.gate$"]))
    assert ct_rules.leaves_unquantized("model.layers.3.mlp.gate") and ct_rules.leaves_unquantized("lm_head")
    assert not ct_rules.leaves_unquantized("model.layers.3.mlp.gate_up")


def test_block_dequantize_covers_partial_blocks():
    w = torch.randn(3, 70, 45)
    q = quantize_block(w, (32, 16))
    assert q.scale.shape == (3, 3, 3)
    scheme = scheme_from_config({**BLOCK_CFG, "weight_block_size": [32, 16]})
    assert torch.equal(dequantize(scheme, q.weight, q.scale), q.dequantized)
    assert (q.dequantized - w).abs().max() <= w.abs().max() / 8  # e4m3: 3 mantissa bits


@pytest.fixture(scope="module")
def qwen_block(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_block")
    quantize_checkpoint(tiny_checkpoint("qwen3_next"), root / "fp8", "block", block=(32, 32), dequantized=root / "ref")
    return root / "fp8", root / "ref"


def edited(src, dst, tensors=lambda t: t, config=lambda c: c):
    """A copy of checkpoint ``src`` with its tensors and config.json edited."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    save_file(tensors(load_file(str(path))), str(path), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config(json.loads((dst / "config.json").read_text()))))
    return dst


Q = "model.layers.1.self_attn.q_proj.weight"
GATE = "model.layers.1.mlp.gate.weight"


def _drop_scale(t):
    del t[Q + "_scale_inv"]
    return t


def _bad_scale(t):
    t[Q + "_scale_inv"] = t[Q + "_scale_inv"][:1]
    return t


def _input_scale(t):
    t[Q.replace("weight", "input_scale")] = torch.tensor(0.01)
    return t


def _fp8_gate(t):
    t[GATE] = t[GATE].to(torch.float8_e4m3fn)
    t[GATE + "_scale_inv"] = torch.ones(1, 1)
    return t


def _e5m2(t):
    t[Q] = t[Q].float().to(torch.float8_e5m2)
    return t


def _kv_scale(t):
    t["model.layers.1.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
    return t


def _scale_of_plain(t):
    t[GATE + "_scale_inv"] = torch.ones(1, 1)
    return t


BROKEN = [
    (_drop_scale, "has no scale"),
    (_bad_scale, "needs (8, 2)"),
    (_input_scale, "static input scale"),
    (_fp8_gate, "leaves module 'model.layers.1.mlp.gate' unquantized"),
    (_e5m2, "F8_E5M2"),
    (_kv_scale, "KV-cache scale"),
    (_scale_of_plain, "not FP8"),
]


@pytest.mark.parametrize("edit,message", BROKEN, ids=[m for _, m in BROKEN])
def test_checkpoint_disagreeing_with_its_config_is_refused(qwen_block, tmp_path, edit, message):
    bad = edited(qwen_block[0], tmp_path / "bad", tensors=edit)
    with pytest.raises(ValueError) as err:
        load_model(bad, torch.float32, "cpu")
    assert message in str(err.value)


def test_fp8_tensors_without_a_config_are_refused(qwen_block, tmp_path):
    bad = edited(
        qwen_block[0], tmp_path / "bad", config=lambda c: {k: v for k, v in c.items() if k != "quantization_config"}
    )
    with pytest.raises(ValueError, match="no quantization_config"):
        load_model(bad, torch.float32, "cpu")


def test_unquantized_modules_load_bit_for_bit(qwen_block, tiny_checkpoint):
    model = load_model(qwen_block[0], torch.float32, "cpu").model
    src = load_file(str(tiny_checkpoint("qwen3_next") / "model.safetensors"))
    targets = model.weight_targets()  # checkpoint name -> the parameter it fills
    assert torch.equal(targets[GATE].parts[0][0], src[GATE])
    assert torch.equal(targets["lm_head.weight"].parts[0][0], src["lm_head.weight"])
    q = targets[Q].parts[0][0]
    assert not torch.equal(q, src[Q])  # quantized: FP8 values, not the source's


def test_modelopt_input_scales_are_read_and_activations_stay_unquantized(tiny_checkpoint, tmp_path):
    quantize_checkpoint(tiny_checkpoint("qwen3_next"), tmp_path / "fp8", "modelopt", dequantized=tmp_path / "ref")
    with_inputs = edited(tmp_path / "fp8", tmp_path / "inputs", tensors=lambda t: _input_scale(t))
    a = load_model(with_inputs, torch.float32, "cpu").model.state_dict()
    b = load_model(tmp_path / "ref", torch.float32, "cpu").model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    wide = edited(
        tmp_path / "fp8", tmp_path / "wide", tensors=lambda t: {**t, Q.replace("weight", "input_scale"): torch.ones(2)}
    )
    with pytest.raises(ValueError, match="expected one value"):
        load_model(wide, torch.float32, "cpu")


def test_fingerprint_names_the_quantization(qwen_block, tmp_path):
    fp8, ref = qwen_block
    assert model_fingerprint(fp8, torch.float32) != model_fingerprint(ref, torch.float32)
    quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
    other = edited(ref, tmp_path / "other")
    before = model_fingerprint(other, torch.float32)
    (other / "hf_quant_config.json").write_text(json.dumps(quant))
    assert model_fingerprint(other, torch.float32) != before


def test_startup_log_states_the_weight_bytes(qwen_block, caplog):
    with caplog.at_level(logging.INFO, logger="workers.loader"):
        model = load_model(qwen_block[0], torch.float32, "cpu").model
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    on_disk = (qwen_block[0] / "model.safetensors").stat().st_size
    line = next(r.getMessage() for r in caplog.records if "bytes resident" in r.getMessage())
    assert f"{resident} bytes resident in float32 from {on_disk} checkpoint bytes" in line
    assert "fp8: FP8 e4m3 weights, block 32x32 scales, dequantized at load" in line
