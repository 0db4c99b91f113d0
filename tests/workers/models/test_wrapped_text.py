"""Multimodal wrappers served for their text part (``workers/models/wrapped_text.py``).

Their equivalence with transformers, every engine suite and TP run through the registry-driven
suite on their ``tools/tiny_registry.py`` entries (prefill, greedy decoding and the other head
tie in ``make test``); this file checks what is particular to them: the towers skipped by name
and nothing else, image and audio content parts refused at the API, the text model type read,
NeMo's per-expert and fused layouts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cluster.api.chat_prompt import ChatSetup, message_dict
from cluster.api.errors import OpenAIError
from cluster.api.protocol import ChatMessage
from workers.loader import image_support, load_model

# registry name -> (has a vision tower, tower prefixes in the saved checkpoint)
WRAPPERS = {
    "lfm2_vl": (True, ("model.vision_tower.", "model.multi_modal_projector.")),
    "lfm3_vl": (True, ("model.vision_tower.", "model.multi_modal_projector.")),
    "minicpmv4_6": (True, ("model.vision_tower.", "model.merger.")),
    "minicpmv4_7": (True, ("model.vision_tower.", "model.merger.")),
    "minicpm_ocr": (True, ("model.vision_tower.", "model.merger.")),
    "nemotron_h_omni": (True, ("vision_model.", "mlp1.", "sound_encoder.", "sound_projection.", "vision_projector.")),
    "nemotron3_5_transcribe": (False, ("perception.", "ctc_timestamp.")),
    "glm5_next": (True, ("model.visual.",)),
}


def tensor_names(ckpt: Path) -> list[str]:
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_towers_are_skipped_by_name_and_media_parts_refused(tiny_checkpoint, name):
    vision, towers = WRAPPERS[name]
    ckpt = tiny_checkpoint(name)
    names = tensor_names(ckpt)
    assert all(any(n.startswith(t) for n in names) for t in towers), "each tower is in the checkpoint"
    model = load_model(ckpt, torch.float32, "cpu").model
    assert model.num_tower_tensors_skipped == sum(n.startswith(towers) for n in names) > 0
    assert model.config.vocab_size == 512 and model.is_vl_checkpoint == vision and not model.serves_images
    assert image_support(ckpt) == (vision, False)

    setup = ChatSetup.for_tokenizer(None, model_dir=str(ckpt))
    assert setup.unserved_vision == vision
    image = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}])
    with pytest.raises(OpenAIError) as err:
        message_dict(0, image, setup)
    assert err.value.status == 400 and err.value.param == "messages.0.content.1"
    assert ("vision tower" in err.value.message) == vision
    audio = ChatMessage(role="user", content=[{"type": "input_audio", "input_audio": {"data": ""}}])
    with pytest.raises(OpenAIError) as err:
        message_dict(0, audio, setup)
    assert err.value.status == 400 and err.value.param == "messages.0.content.0.type"
    assert message_dict(0, ChatMessage(role="user", content=[{"type": "text", "text": "hi"}]), setup)["content"] == "hi"


def test_a_missing_text_tensor_or_an_unknown_one_is_an_error(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("minicpmv4_6")

    def edited(dst: str, edit) -> Path:
        out = shutil.copytree(src, tmp_path / dst)
        tensors = load_file(str(out / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out

    missing = edited("missing", lambda t: t.pop("model.language_model.layers.0.linear_attn.in_proj_z.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.0\.linear_attn\.in_proj_z"):
        load_model(missing, torch.float32, "cpu")
    extra = edited("extra", lambda t: t.update({"model.audio.proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.audio\.proj\.weight'"):
        load_model(extra, torch.float32, "cpu")


@pytest.mark.parametrize("name,other", [("lfm2_vl", "lfm2_moe"), ("minicpm_ocr", "qwen3_5_moe_text")])
def test_another_text_model_type_is_refused_by_name(tiny_checkpoint, tmp_path, name, other):
    ckpt = shutil.copytree(tiny_checkpoint(name), tmp_path / "c")
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["model_type"] = other
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"text_config.model_type='{other}'"):
        load_model(ckpt, torch.float32, "cpu")


def test_nemo_per_expert_and_fused_layouts_load_the_same(tiny_checkpoint, tmp_path):
    """The registry's transcribe checkpoint has NeMo's fused transposed experts (as released);
    transformers' ``save_pretrained`` writes them per expert. Both load to the same model."""
    fused = tiny_checkpoint("nemotron3_5_transcribe")
    assert "llm.model.layers.1.mixer.experts.gate_and_up_projs" in tensor_names(fused)
    per_expert = shutil.copytree(fused, tmp_path / "per_expert")
    tensors = load_file(str(per_expert / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("gate_and_up_projs", "down_projs"))]:
        stacked, kind = tensors.pop(key), "up" if key.endswith("gate_and_up_projs") else "down"
        prefix = key.rsplit(".", 1)[0]
        for e in range(stacked.shape[0]):
            tensors[f"{prefix}.{e}.{kind}_proj.weight"] = stacked[e].t().contiguous()
    save_file(tensors, str(per_expert / "model.safetensors"), metadata={"format": "pt"})
    a, b = (load_model(d, torch.float32, "cpu").model for d in (fused, per_expert))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
