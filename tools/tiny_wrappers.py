"""Tiny configs of the multimodal wrappers whose language model is a served family
(``tiny_registry``): the text part is the family's own tiny config, the towers and projectors
beside it are as small as their configs allow (one or two layers, hidden 32). Only the text
part is served; the towers are there so that loading skips their tensors by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from tools import tiny_qwen3_5 as q35

_NEMO_EXPERT = re.compile(r"^(llm\.model\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up|down)_proj\.weight$")

SIGLIP2 = dict(
    model_type="siglip2_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    patch_size=4,
    num_patches=16,
)
LFM3_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=1,
)
RADIO = dict(
    model_type="radio",
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    patch_size=4,
    image_size=16,
    max_img_size=32,
    num_cls_tokens=1,
    num_registers=1,
    video_temporal_patch_size=2,
)
PARAKEET = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=64,
    conv_kernel_size=3,
    subsampling_conv_channels=8,
    num_mel_bins=16,
    projection_hidden_size=32,
    projection_bias=False,
)
MINICPM_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    patch_size=4,
    image_size=16,
    insert_layer_id=0,
)
TRANSCRIBE_AUDIO = dict(
    asr_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_mel_bins=16),
    diarization_config=dict(
        audio_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_mel_bins=16
        ),
        head_config=dict(hidden_size=16, num_speakers=2, audio_hidden_size=32),
        streaming_config=dict(num_speakers=2),
    ),
)
TRANSCRIBE_TIMESTAMPS = dict(
    hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=16, blank_token_id=15
)


def lfm2_vl(text: dict[str, Any]) -> dict[str, Any]:
    return dict(
        text_config=dict(text, model_type="lfm2"),
        vision_config=SIGLIP2,
        projector_hidden_size=32,
        tie_word_embeddings=text["tie_word_embeddings"],
    )


def lfm3_vl(text: dict[str, Any]) -> dict[str, Any]:
    return dict(
        text_config=dict(text, model_type="lfm3"),
        vision_config=LFM3_VISION,
        projector_hidden_size=32,
        tie_word_embeddings=text["tie_word_embeddings"],
    )


def nemotron_h_omni(text: dict[str, Any]) -> dict[str, Any]:
    return dict(
        text_config=dict(text, model_type="nemotron_h"),
        vision_config=RADIO,
        audio_config=PARAKEET,
        vision_hidden_size=32,
        projector_hidden_size=32,
        tie_word_embeddings=False,
    )


def nemotron_transcribe(text: dict[str, Any]) -> dict[str, Any]:
    return dict(
        text_config=dict(text, model_type="nemotron_h"),
        audio_config=TRANSCRIBE_AUDIO,
        word_timestamp_config=TRANSCRIBE_TIMESTAMPS,
        tie_word_embeddings=False,  # not a field of its config (it never ties); set for the head-tie test
    )


def minicpm(text: dict[str, Any] = q35.DENSE, tie: bool = False) -> dict[str, Any]:
    return dict(
        text_config=dict(text, model_type="qwen3_5_text"),
        vision_config=MINICPM_VISION,
        insert_layer_id=0,
        tie_word_embeddings=tie,
    )


# GLM-5.3-Flash (text ``glm5_next_text``): indexer blocks of 4 with 2 kept, so prompts past 11
# tokens attend to a subset; layer 2 shares layer 1's selection; SwiGLUs clipped at 2 (it binds).
GLM5_NEXT_TEXT = dict(
    hidden_size=64, num_hidden_layers=5, max_position_embeddings=4096,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    indexer_types=["full", "full", "shared", "full", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=0, v_head_dim=24, index_n_heads=8, index_head_dim=16, index_topk=8, index_kpool=4,
    linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=96,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    n_shared_experts=1, hc_mult=3, swiglu_limit=2.0,
)  # fmt: skip
GLM5_NEXT_VISION = dict(
    depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=32,
    projection_intermediate_size=32, patch_size=4, image_size=16,
)  # fmt: skip


def glm5_next() -> dict[str, Any]:
    return dict(text_config=dict(GLM5_NEXT_TEXT), vision_config=GLM5_NEXT_VISION, tie_word_embeddings=False)


def fuse_nemo_experts(out_dir: Path) -> None:
    """Per-expert ``llm.model.layers.{i}.mixer.experts.{e}.{up,down}_proj.weight`` -> NeMo's
    fused ``experts.gate_and_up_projs`` [E, H, I] / ``experts.down_projs`` [E, I, H] (one file)."""
    from safetensors.torch import load_file, save_file

    path = out_dir / "model.safetensors"
    if (out_dir / "model.safetensors.index.json").exists():
        raise ValueError(f"fuse_nemo_experts needs a checkpoint in one file; {out_dir} is sharded")
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for key, t in load_file(str(path)).items():
        m = _NEMO_EXPERT.match(key)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[key] = t
    for prefix, parts in groups.items():
        experts = range(1 + max(e for e, _ in parts))
        out[f"{prefix}.gate_and_up_projs"] = torch.stack([parts[(e, "up")].t() for e in experts]).contiguous()
        out[f"{prefix}.down_projs"] = torch.stack([parts[(e, "down")].t() for e in experts]).contiguous()
    save_file(out, str(path), metadata={"format": "pt"})
