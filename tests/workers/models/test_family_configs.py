"""Per-family config handling: fields refused with their name, legacy checkpoint forms that
load to the same model (fused experts too), speculation refused for families without MTP
weights (Nemotron-H's MTP head: ``test_nemotron_mtp.py``).

(Config variants whose math we serve are compared with transformers in
``test_vs_transformers.py``; the registry suite covers each family's default tiny config.)
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.workers.engine.helpers import make_llm
from tests.workers.models.harness import Harness, random_prompts
from tools.tiny import tiny_config
from tools.tiny_registry import get_family
from workers.loader import load_model
from workers.models import get_model_class

REFUSED = {
    "nemotron_attention_bias": ("nemotron_h", {"attention_bias": True}, "attention_bias"),
    "nemotron_sliding_window": ("nemotron_h", {"sliding_window": 64}, "sliding_window"),
    "nemotron_residual_fp32": ("nemotron_h", {"residual_in_fp32": True}, "residual_in_fp32"),
    "nemotron_shared_experts": ("nemotron_h", {"n_shared_experts": 2}, "n_shared_experts"),
    "nemotron_mamba_proj_bias": ("nemotron_h", {"mamba_proj_bias": True}, "mamba_proj_bias"),
    "nemotron_mamba_act": ("nemotron_h", {"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    "nemotron_mlp_act": ("nemotron_h", {"mlp_hidden_act": "quick_gelu"}, "mlp_hidden_act"),
    "nemotron_router_groups": ("nemotron_h", {"n_group": 3}, "n_group=3"),
    "mamba2_act": ("mamba2", {"hidden_act": "gelu"}, "hidden_act"),
    "bamba_act": ("bamba", {"hidden_act": "gelu"}, "hidden_act"),
    "bamba_rope": (
        "bamba",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        "rope_type",
    ),
    "falcon_act": ("falcon_h1", {"hidden_act": "gelu"}, "hidden_act"),
    "falcon_rope": (
        "falcon_h1",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        "rope_type",
    ),
    "falcon_ssm_multipliers": ("falcon_h1", {"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers"),
    "mamba_act": ("mamba", {"hidden_act": "gelu"}, "hidden_act"),
    "falcon_mamba_act": ("falcon_mamba", {"hidden_act": "gelu"}, "hidden_act"),
    "zamba_mamba_act": ("zamba", {"hidden_mamba_act": "gelu"}, "hidden_mamba_act"),
    "zamba_attention_width": ("zamba", {"attention_hidden_size": 96}, "attention_hidden_size=96"),
    "zamba2_adapters_with_gqa": ("zamba2", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
    "zamba2_mlp_act": ("zamba2", {"hidden_act": "quick_gelu"}, "hidden_act"),
    "qwen3_5_no_output_gate": ("qwen3_5", {"attn_output_gate": False}, "attn_output_gate=False"),
    "qwen3_5_layer_scale": ("qwen3_5", {"layer_scale": True}, "layer_scale=True"),
    "qwen3_5_ssm_dtype": ("qwen3_5_vl", {"mamba_ssm_dtype": "bfloat16"}, "mamba_ssm_dtype='bfloat16'"),
    "qwen3_5_act": ("qwen3_5", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    "qwen3_5_rope": (
        "qwen3_5",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
        "rope_type='yarn'",
    ),
    "qwen3_5_moe_sparse_step": ("qwen3_5_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    "qwen3_5_moe_mlp_only": ("qwen3_5_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    "qwen3_5_moe_topk_norm": ("qwen3_5_moe_vl", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    "qwen_mtp_layers": ("qwen3_5", {"mtp_num_hidden_layers": -1}, "mtp_num_hidden_layers=-1"),
    "jamba_act": ("jamba", {"hidden_act": "gelu"}, "hidden_act"),
    "jamba_sliding_window": ("jamba", {"sliding_window": 64}, "sliding_window"),
    "lfm2_rope": ("lfm2", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    "lfm2_partial_rope": (
        "lfm2",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        "partial_rotary_factor",
    ),
    "lfm2_sliding_layer": (
        "lfm2",
        {"layer_types": ["conv", "sliding_attention", "conv", "conv", "full_attention"]},
        "layer_types",
    ),
    "lfm2_moe_dense_layers": ("lfm2_moe", {"num_dense_layers": 9}, "num_dense_layers=9"),
    "lfm3_no_window": ("lfm3", {"sliding_window": None}, "sliding_window"),
    "lfm3_rope_type": (
        "lfm3",
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            }
        },
        "rope_type='linear'",
    ),
    "lfm3_default_partial": (
        "lfm3",
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
            }
        },
        "partial_rotary_factor",
    ),
    "kimi_act": ("kimi_linear", {"hidden_act": "gelu"}, "hidden_act"),
    "kimi_mla_kv_heads": ("kimi_linear", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
    "bailing_yarn": (
        "bailing_hybrid",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 2.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 1024,
            }
        },
        "rope_type",
    ),
    "bailing_mla_kv_heads": ("bailing_hybrid", {"num_key_value_heads": 1}, "num_key_value_heads=1"),
    "bailing_swiglu_limits_per_layer": (
        "bailing_hybrid",
        {"expert_swiglu_limit_list": [7.0, 7.0]},
        r"expert_swiglu_limit_list=\[7.0, 7.0\].*num_hidden_layers=5",
    ),
    "bailing_swiglu_limit_negative": (
        "bailing_hybrid",
        {"share_expert_swiglu_limit_list": [0, -1.5, 0, 0, 0]},
        r"share_expert_swiglu_limit_list has entries \[-1.5\]",
    ),
    "minimax_sliding_window": ("minimax", {"sliding_window": 64}, "sliding_window"),
    "minimax_act": ("minimax", {"hidden_act": "quick_gelu"}, "hidden_act"),
    "minimax_rope": (
        "minimax",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        "rope_type",
    ),
    "olmo_grouped_linear_heads": ("olmo_hybrid", {"linear_num_key_heads": 2}, "linear_num_key_heads=2"),
    "olmo_act": ("olmo_hybrid", {"hidden_act": "gelu"}, "hidden_act"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unserved_fields_are_refused_by_name(case: str) -> None:
    arch, overrides, field = REFUSED[case]
    cfg = tiny_config(arch, 512, 0, **overrides)
    with pytest.raises(ValueError, match=field):
        get_model_class(get_family(arch).architecture)(cfg, torch.float32, "meta")


def _prefill_logits(model_dir: Path) -> list[torch.Tensor]:
    model = load_model(model_dir, torch.float32, "cpu").model
    return Harness(model).prefill(random_prompts(model.config.vocab_size, [5, 23], seed=4))


def _rewrite(src: Path, dst: Path, edit_config=None, rename=None, extra=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_config is not None:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if rename is not None or extra is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        tensors = {rename(n) if rename else n: t for n, t in tensors.items()}
        save_file({**tensors, **(extra or {})}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_nemotron_legacy_hybrid_override_pattern(tiny_checkpoint, tmp_path) -> None:
    src = tiny_checkpoint("nemotron_h")
    symbols = {"linear_attention": "M", "moe": "E", "full_attention": "*", "mlp": "-"}

    def to_pattern(raw: dict) -> None:
        raw["hybrid_override_pattern"] = "".join(symbols[k] for k in raw.pop("layers_block_type"))

    legacy = _rewrite(src, tmp_path / "legacy", edit_config=to_pattern)
    assert "hybrid_override_pattern" in json.loads((legacy / "config.json").read_text())
    for a, b in zip(_prefill_logits(src), _prefill_logits(legacy)):
        assert torch.equal(a, b)


def test_mamba2_original_embedding_name(tiny_checkpoint, tmp_path) -> None:
    src = tiny_checkpoint("mamba2")
    old = _rewrite(src, tmp_path / "old", rename=lambda n: n.replace("backbone.embeddings.", "backbone.embedding."))
    for a, b in zip(_prefill_logits(src), _prefill_logits(old)):
        assert torch.equal(a, b)


def test_zamba2_repeated_shared_block_tensors_load(tiny_checkpoint, tmp_path) -> None:
    """A checkpoint may repeat a shared block's tensors under every layer that reuses it."""
    from safetensors.torch import load_file

    src = tiny_checkpoint("zamba2")
    hybrid = [i for i, k in enumerate(get_family("zamba2").config["layers_block_type"]) if k == "hybrid"]
    first, reuse = hybrid[0], hybrid[2]  # block 0 at invocations 0 and 2
    tensors = load_file(str(src / "model.safetensors"))
    prefix = f"model.layers.{first}.shared_transformer."
    extra = {
        n.replace(f"layers.{first}.", f"layers.{reuse}.", 1): t.clone()
        for n, t in tensors.items()
        if n.startswith(prefix)
    }
    assert extra
    repeated = _rewrite(src, tmp_path / "repeated", extra=extra)
    for a, b in zip(_prefill_logits(src), _prefill_logits(repeated)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["jamba", "lfm2", "lfm2_moe", "lfm3"])
def test_speculation_is_refused_without_mtp_weights(family, tiny_checkpoint) -> None:
    """None of these checkpoints carries MTP weights: ``spec.method: mtp`` is refused, naming
    the architecture, before anything is served."""
    architecture = get_family(family).architecture
    with pytest.raises(ValueError, match=f"spec.method 'mtp'.*{architecture} has none"):
        make_llm(tiny_checkpoint(family), spec={"method": "mtp", "num_draft_tokens": 2})


_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@pytest.mark.parametrize("family", ["jamba", "lfm2_moe"])
def test_fused_experts_load_to_the_same_model(family, tiny_checkpoint, tmp_path) -> None:
    """transformers' in-memory expert layout (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) loads to the same logits as the per-expert one."""
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint(family)
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, t in load_file(str(fused / "model.safetensors")).items():
        m = _EXPERT_TENSOR.match(name)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), _EXPERT_PART[m.group(3)])] = t
        else:
            out[name] = t
    assert groups
    for prefix, parts in groups.items():
        experts = range(1 + max(e for e, _ in parts))
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in experts]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down")] for e in experts])
    save_file(out, str(fused / "model.safetensors"), metadata={"format": "pt"})
    for a, b in zip(_prefill_logits(src), _prefill_logits(fused)):
        assert torch.equal(a, b)
