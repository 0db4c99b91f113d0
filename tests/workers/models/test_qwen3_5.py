"""What is particular to Qwen3.5 / 3.6: VL checkpoints, weight layouts, released field values.

Their equivalence with transformers (config variants included), every engine suite, TP and
speculation run through the registry-driven suite on the ``qwen3_5*`` entries of
``tools/tiny_registry.py``; refused config fields are in ``test_family_configs.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tools.tiny_qwen3_5 import fuse_experts
from workers.loader import image_support, load_model
from workers.models.moe import unfuse_expert_tensors


def tensor_names(ckpt: Path) -> list[str]:
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return list(f.keys())


def edit(ckpt: Path, dst: Path, tensors=None, **fields) -> Path:
    """A copy of ``ckpt`` with ``tensors(dict)`` applied and ``fields`` set in the text config."""
    shutil.copytree(ckpt, dst)
    if tensors is not None:
        data = load_file(str(dst / "model.safetensors"))
        tensors(data)
        save_file(data, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if fields:
        raw = json.loads((dst / "config.json").read_text())
        (raw.get("text_config") or raw).update(fields)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_vl_checkpoint_serves_the_text_part(tiny_checkpoint, name):
    ckpt = tiny_checkpoint(name)
    names = tensor_names(ckpt)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    model = load_model(ckpt, torch.float32, "cpu").model
    assert model.num_vision_tensors_skipped == sum(n.startswith("model.visual.") for n in names) > 0
    assert model.is_vl_checkpoint and not model.serves_images
    assert image_support(ckpt) == (True, False)
    # the served config is the language model's, not the composite one
    assert model.config.model_type.endswith("_text") and model.config.vocab_size == 512


def test_text_checkpoints_say_they_have_no_vision_tower(tiny_checkpoint, tiny_granite_dir):
    for ckpt in (tiny_checkpoint("qwen3_5"), tiny_checkpoint("qwen3_5_moe"), tiny_granite_dir):
        assert image_support(ckpt) == (False, False)
        assert not load_model(ckpt, torch.float32, "cpu").model.is_vl_checkpoint


def test_vl_checkpoint_ties_at_its_top_level(tiny_checkpoint, tmp_path):
    """transformers ties a VL model's lm_head by the top-level tie_word_embeddings, whatever
    text_config says: tied in text_config only, lm_head stays its own tensor."""
    from tests.workers.models.harness import Harness, random_prompts
    from tests.workers.models.hf_oracle import HFOracle

    ckpt = edit(tiny_checkpoint("qwen3_5_vl"), tmp_path / "c", tie_word_embeddings=True)
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is False
    model = load_model(ckpt, torch.float32, "cpu").model
    assert not model.tie_word_embeddings and model.lm_head is not None
    prompt = random_prompts(model.config.vocab_size, [9], seed=2)[0]
    got = Harness(model).prefill([prompt])[0]
    assert (got - HFOracle(ckpt).logits(prompt)).abs().max().item() <= 1e-4


def test_vl_engine_reads_the_text_config(tiny_checkpoint, tmp_path):
    """max_position_embeddings, vocab and eos come from text_config."""
    from tests.workers.engine.helpers import GREEDY, make_llm

    ckpt = edit(tiny_checkpoint("qwen3_5_vl"), tmp_path / "c", max_position_embeddings=48)
    llm = make_llm(ckpt)
    assert llm.engine.max_model_len == 48 and llm.engine.vocab_size == 512
    with pytest.raises(ValueError, match="48"):
        llm.generate_ids([list(range(3, 60))], [GREEDY])


def test_vl_checkpoint_never_drops_a_text_tensor(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_5_vl")
    missing = edit(
        src, tmp_path / "missing", tensors=lambda t: t.pop("model.language_model.layers.0.linear_attn.in_proj_z.weight")
    )
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.0\.linear_attn\.in_proj_z"):
        load_model(missing, torch.float32, "cpu")
    extra = edit(src, tmp_path / "extra", tensors=lambda t: t.update({"model.audio.proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.audio\.proj\.weight'"):
        load_model(extra, torch.float32, "cpu")


def test_text_class_reads_the_language_model_prefix(tiny_checkpoint, tmp_path):
    """A ``Qwen3_5ForCausalLM`` checkpoint saved with ``model.language_model.*`` names loads
    the same (transformers maps that prefix for this class too)."""
    src = tiny_checkpoint("qwen3_5")

    def rename(t):
        for n in [n for n in t if n.startswith("model.")]:
            t["model.language_model." + n[len("model.") :]] = t.pop(n)

    moved = edit(src, tmp_path / "c", tensors=rename)
    a, b = (load_model(d, torch.float32, "cpu").model for d in (src, moved))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_fused_and_per_expert_layouts_load_the_same(tiny_checkpoint, tmp_path):
    per_expert = tiny_checkpoint("qwen3_5_moe")
    fused = shutil.copytree(per_expert, tmp_path / "fused")
    fuse_experts(fused)
    names = tensor_names(fused)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "mtp.layers.0.mlp.experts.down_proj" in names
    assert not any(".experts.0." in n for n in names)
    a, b = (load_model(d, torch.float32, "cpu").model for d in (per_expert, fused))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.mtp_weights.keys() == b.mtp_weights.keys()
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj.*shape \(4, 3, 8\)"):
        list(unfuse_expert_tensors([("x.experts.gate_up_proj", torch.zeros(4, 3, 8))]))


def test_released_field_values_are_accepted(tiny_checkpoint, tmp_path):
    """The values Qwen3.5 / 3.6 configs ship with load (and mean the math implemented)."""
    fields = {
        "attn_output_gate": True,
        "layer_scale": False,
        "mamba_ssm_dtype": "float32",
        "mtp_use_dedicated_embeddings": False,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "full_attention_interval": 4,
    }
    ckpt = edit(tiny_checkpoint("qwen3_5_moe_vl"), tmp_path / "c", **fields)
    model = load_model(ckpt, torch.float32, "cpu").model
    model.build_mtp_head(kv_index=2)
