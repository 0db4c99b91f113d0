"""The loader and the strict weight mapping: sharding, missing / misshapen / unexpected
tensors, unknown architectures, mtp.* set aside, cheap config checks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.tiny import make_tiny_checkpoint
from workers.loader import load_model
from workers.models import SUPPORTED_ARCHITECTURES, get_model_class


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("q"), seed=3, mtp=True)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_tensors(ckpt: Path, edit) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid", "qwen3_5_vl"])
def test_sharded_checkpoint_equals_unsharded(arch: str, tmp_path: Path) -> None:
    mtp = arch != "granitemoehybrid"
    one = make_tiny_checkpoint(arch, tmp_path / "one", seed=4, mtp=mtp)
    many = make_tiny_checkpoint(arch, tmp_path / "many", seed=4, shards=3, mtp=mtp)
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not (many / "model.safetensors").exists()
    a, b = (load_model(d, torch.float32, "cpu").model for d in (one, many))
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.mtp_weights.keys() == b.mtp_weights.keys()
    assert all(torch.equal(a.mtp_weights[k], b.mtp_weights[k]) for k in a.mtp_weights)
    if mtp:
        assert all(index["weight_map"][k] for k in b.mtp_weights)


def test_mtp_tensors_are_kept_aside(qwen_dir: Path) -> None:
    model = load_model(qwen_dir, torch.float32, "cpu").model
    names = set(model.mtp_weights)
    for required in (
        "mtp.fc.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.experts.0.gate_proj.weight",
        "mtp.layers.0.mlp.shared_expert_gate.weight",
    ):
        assert required in names
    h = model.config.hidden_size
    assert model.mtp_weights["mtp.fc.weight"].shape == (h, 2 * h)
    assert not any(name.startswith("mtp.") for name in model.state_dict())


def test_missing_tensor_is_named(qwen_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(qwen_dir, tmp_path / "c")
    name = "model.layers.2.linear_attn.in_proj_ba.weight"
    edit_tensors(ckpt, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=re.escape(name)):
        load_model(ckpt, torch.float32, "cpu")


def test_missing_expert_is_named(qwen_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(qwen_dir, tmp_path / "c")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    edit_tensors(ckpt, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=re.escape(name)):
        load_model(ckpt, torch.float32, "cpu")


def test_wrong_shape_names_tensor_and_both_shapes(qwen_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(qwen_dir, tmp_path / "c")
    name = "model.layers.1.self_attn.k_proj.weight"

    def shrink(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1].clone()

    edit_tensors(ckpt, shrink)
    with pytest.raises(ValueError) as err:
        load_model(ckpt, torch.float32, "cpu")
    msg = str(err.value)
    assert name in msg and "(63, 64)" in msg and "(64, 64)" in msg


def test_unexpected_tensor_is_named(qwen_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(qwen_dir, tmp_path / "c")
    edit_tensors(ckpt, lambda t: t.update({"model.layers.0.bogus.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=re.escape("model.layers.0.bogus.weight")):
        load_model(ckpt, torch.float32, "cpu")


def test_unknown_architecture_lists_supported(qwen_dir: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(qwen_dir, tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        load_model(ckpt, torch.float32, "cpu")
    assert "LlamaForCausalLM" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match="Qwen3NextForCausalLM"):
        get_model_class("JevForDecision")  # a decision head over Qwen3.5, no language-model head


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("quantization_config", {"quant_method": "gptq", "bits": 4}, "quant_method=.gptq."),
        ("auto_map", {"AutoModelForCausalLM": "x.Model"}, "remote code"),
        ("hidden_act", "gelu", "hidden_act"),
        (
            "rope_parameters",
            {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 0.25},
            "rope_type",
        ),
        ("linear_num_value_heads", 3, "linear_num_value_heads"),
    ],
)
def test_unservable_config_is_rejected(qwen_dir: Path, tmp_path: Path, field: str, value: object, needle: str) -> None:
    ckpt = copy_ckpt(qwen_dir, tmp_path / "c")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=needle):
        load_model(ckpt, torch.float32, "cpu")


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint("granitemoehybrid", tmp_path, seed=1, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(ckpt / "model.safetensors"))
    model = load_model(ckpt, torch.float32, "cpu").model
    hidden = torch.randn(3, model.config.hidden_size)
    expected = hidden @ model.model.embed_tokens.weight.T / model.config.logits_scaling
    assert torch.allclose(model.compute_logits(hidden), expected, atol=1e-5)


def test_registry() -> None:
    assert get_model_class("Qwen3NextForCausalLM").__name__ == "Qwen3NextForCausalLM"
    assert get_model_class("GraniteMoeHybridForCausalLM").__name__ == "GraniteMoeHybridForCausalLM"
