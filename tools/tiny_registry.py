"""The registry of tiny checkpoints: one entry per served family.

Each ``TinyFamily`` names the transformers classes of the family, its tiny config, how its
weights are re-drawn and whether it carries MTP weights. ``tools.tiny`` builds a
checkpoint from an entry (``make_tiny_checkpoint(name, dir)``), and the registry-driven test
suite (``tests/workers/models``, ``tests/workers/engine``, ``tests/workers/tp``, every test
taking the ``tiny_model_dir`` fixture) checks every entry the same way: transformers
equality, prefix cache / overlap / chunking / preemption invariance, speculation when
``mtp``, TP equality at ``tp_world``. Adding a family = its model file, its line in
``workers/models/__init__.py`` and one entry here.

The tiny configs are small (hidden 64) but exercise what the family's math does: several
kinds of layers, GQA, SSD chunks of 16 (prompts in the tests cross them), multipliers set
off 1. ``time_step_min=1e-9`` for Nemotron-H and Zamba2: transformers clamps dt at it (from
below) only in its chunked prefill path, not in its one-token decode step, while we clamp in
both; greedy decoding is compared where the clamp never binds (Zamba2's clamp itself is
checked on prefill logits with a real ``time_step_min``). Nemotron-H clamps with
``time_step_limit`` as transformers 5.25 does; the pinned 5.24 clamps at ``time_step_min``,
which at 1e-9 agrees (``tests/workers/models/test_dt_limits.py`` checks the clamps against
the formula). Each family is also compared with the other head tie
(``tests/workers/models/test_head_tie.py``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools import tiny_inkling2 as ink2
from tools import tiny_qwen3_5 as q35
from tools import tiny_wrappers as tw
from tools.tiny_weights import (
    RedrawRule,
    add_nemotron_mtp,
    add_qwen_mtp,
    keep_lightning_buffers,
    redraw_decay_logs,
    redraw_glm5_next,
    redraw_global_scales,
    redraw_inkling2,
    redraw_mamba1,
    redraw_rglru,
    redraw_zaya,
)

MtpWriter = Callable[[Path, Any, int], None]      # (checkpoint dir, hf config, seed)
LayoutWriter = Callable[[Path], None]             # rewrites a saved checkpoint's tensors


@dataclass(frozen=True)
class TinyFamily:
    name: str                       # registry key (``make_tiny_checkpoint``'s arch)
    architecture: str               # config.json ``architectures[0]``: the HF model class
    config_class: str               # the transformers config class
    config: Mapping[str, Any]       # the tiny config (vocab, eos / pad / bos ids are added)
    zero_centered_norms: bool = False   # model norms are ``1 + w`` (redrawn near 0)
    redraw: RedrawRule | None = None     # the family's own rule, asked before the generic one
    mtp_writer: MtpWriter | None = None  # adds random ``mtp.*`` tensors (the family has MTP)
    tp_world: int = 2               # the TP size the suite compares with TP = 1
    hf_modeling: str = ""           # transformers module whose torch paths the oracle uses
    notes: tuple[str, ...] = field(default=())
    # a composite (vision-language) config: the language model's sub-config, which gets the
    # vocab / eos ids and the overrides (``tie_word_embeddings`` also goes to the top level)
    text_config_key: str | None = None
    layout_writer: LayoutWriter | None = None    # e.g. experts fused as a released checkpoint
    # its layers and states are another family's (a multimodal wrapper always is): ``make test``
    # checks only its equality with transformers, the engine suite runs with ``slow``
    light: bool = False

    @property
    def has_mtp(self) -> bool:
        return self.mtp_writer is not None


_QWEN3_NEXT = TinyFamily(
    "qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
    dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=4096, head_dim=32, intermediate_size=128,
         layer_types=["linear_attention", "full_attention", "linear_attention",
                      "linear_attention", "full_attention"],
         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
         linear_value_head_dim=16, linear_conv_kernel_dim=4,
         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
         shared_expert_intermediate_size=32, decoder_sparse_step=1,
         mlp_only_layers=[0], tie_word_embeddings=False),
    zero_centered_norms=True, mtp_writer=add_qwen_mtp,
    hf_modeling="transformers.models.qwen3_next.modeling_qwen3_next")

_GRANITE = TinyFamily(
    "granitemoehybrid", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
    dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=4096, intermediate_size=32, shared_intermediate_size=64,
         layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
         num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
         mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
         mamba_chunk_size=16, position_embedding_type="rope",
         embedding_multiplier=1.0, residual_multiplier=0.5,
         attention_multiplier=0.125, logits_scaling=2.0, tie_word_embeddings=False),
    hf_modeling="transformers.models.granitemoehybrid.modeling_granitemoehybrid")

_MAMBA2 = TinyFamily(
    "mamba2", "Mamba2ForCausalLM", "Mamba2Config",
    dict(hidden_size=64, num_hidden_layers=4, num_heads=8, head_dim=16, expand=2,
         state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, use_bias=False,
         use_conv_bias=True, residual_in_fp32=True, tie_word_embeddings=False),
    hf_modeling="transformers.models.mamba2.modeling_mamba2",
    notes=("pure Mamba2: no attention, so no KV tensors (page bookkeeping only)",))

_NEMOTRON_H = TinyFamily(
    "nemotron_h", "NemotronHForCausalLM", "NemotronHConfig",
    dict(hidden_size=64, max_position_embeddings=4096,
         layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention",
                            "mlp", "full_attention"],
         num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
         mlp_hidden_act="relu2", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
         n_groups=2, conv_kernel=4, chunk_size=16, time_step_min=1e-9,
         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
         moe_shared_expert_intermediate_size=48, n_group=4, topk_group=2,
         routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
         num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"]),
    mtp_writer=add_nemotron_mtp, hf_modeling="transformers.models.nemotron_h.modeling_nemotron_h",
    notes=("one MTP layer of an attention and a MoE block, as Nemotron 3 Super's",))

_BAMBA = TinyFamily(
    "bamba", "BambaForCausalLM", "BambaConfig",
    dict(hidden_size=64, num_hidden_layers=5, attn_layer_indices=[1, 4],
         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
         intermediate_size=96, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
         mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, tie_word_embeddings=False),
    hf_modeling="transformers.models.bamba.modeling_bamba")

_FALCON_H1 = TinyFamily(
    "falcon_h1", "FalconH1ForCausalLM", "FalconH1Config",
    dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=4096, intermediate_size=96, mamba_d_ssm=96,
         mamba_n_heads=6, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
         mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=False,
         projectors_bias=True, lm_head_multiplier=0.8, embedding_multiplier=2.0,
         mlp_multipliers=[0.9, 1.1], key_multiplier=0.7, attention_out_multiplier=0.6,
         attention_in_multiplier=1.2, ssm_multipliers=[0.8, 1.1, 0.9, 1.2, 0.7],
         ssm_in_multiplier=1.3, ssm_out_multiplier=0.9, tie_word_embeddings=False),
    hf_modeling="transformers.models.falcon_h1.modeling_falcon_h1")

_ZAMBA2 = TinyFamily(
    "zamba2", "Zamba2ForCausalLM", "Zamba2Config",
    dict(hidden_size=64, num_hidden_layers=6, max_position_embeddings=4096,
         layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid",
                            "linear_attention", "hybrid"],
         num_attention_heads=4, num_key_value_heads=4, mamba_d_state=16, mamba_d_conv=4,
         mamba_expand=2, n_mamba_heads=8, mamba_ngroups=2, chunk_size=16, time_step_min=1e-9,
         intermediate_size=96, hidden_act="gelu", num_mem_blocks=2,
         use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True),
    hf_modeling="transformers.models.zamba2.modeling_zamba2",
    notes=("two shared attention blocks over three hybrid layers: the third reuses block 0 "
           "with its own LoRA adapters and its own KV",))

_Q35 = "transformers.models.qwen3_5.modeling_qwen3_5"
_Q35_MOE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
_QWEN3_5 = TinyFamily("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", q35.DENSE,
                      zero_centered_norms=True, mtp_writer=add_qwen_mtp, hf_modeling=_Q35)
_QWEN3_5_MOE = TinyFamily("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", q35.MOE,
                          zero_centered_norms=True, mtp_writer=add_qwen_mtp, hf_modeling=_Q35_MOE)
_QWEN3_5_VL = TinyFamily(
    "qwen3_5_vl", "Qwen3_5ForConditionalGeneration", "Qwen3_5Config", q35.vl_config(q35.DENSE),
    zero_centered_norms=True, mtp_writer=add_qwen_mtp, hf_modeling=_Q35,
    text_config_key="text_config",
    notes=("the released vision-language layout: the vision tower is skipped, the text served",))
_QWEN3_5_MOE_VL = TinyFamily(
    "qwen3_5_moe_vl", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig",
    q35.vl_config(q35.MOE), zero_centered_norms=True, mtp_writer=add_qwen_mtp,
    hf_modeling=_Q35_MOE, text_config_key="text_config", layout_writer=q35.fuse_experts,
    notes=("experts fused (experts.gate_up_proj / down_proj), as released checkpoints may be",))

_JAMBA = TinyFamily(
    "jamba", "JambaForCausalLM", "JambaConfig",
    dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=4096, intermediate_size=96, attn_layer_period=3,
         attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
         num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
         mamba_dt_rank=8, mamba_conv_bias=True, mamba_proj_bias=False, tie_word_embeddings=False),
    redraw=redraw_mamba1, hf_modeling="transformers.models.jamba.modeling_jamba",
    notes=("Mamba1 layers 0, 2, 3 and NoPE attention 1, 4; MoE in layers 1 and 3",))

_LFM2 = TinyFamily(
    "lfm2", "Lfm2ForCausalLM", "Lfm2Config",
    dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=4096, intermediate_size=144, block_multiple_of=32,
         block_ffn_dim_multiplier=1.5, full_attn_idxs=[1, 4], conv_L_cache=3,
         tie_word_embeddings=True),
    hf_modeling="transformers.models.lfm2.modeling_lfm2",
    notes=("short convs 0, 2, 3 (no scan state) and RoPE attention 1, 4; the MLP width is "
           "auto-adjusted: int(1.5 * int(2 * 144 / 3)) = 144, rounded up to 160",))

_LFM2_MOE = TinyFamily(
    "lfm2_moe", "Lfm2MoeForCausalLM", "Lfm2MoeConfig",
    dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=4096, intermediate_size=96, moe_intermediate_size=32,
         num_experts=8, num_experts_per_tok=2, num_dense_layers=1, use_expert_bias=True,
         routed_scaling_factor=1.5, norm_topk_prob=True, conv_L_cache=4, conv_bias=True,
         layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
         tie_word_embeddings=False),
    hf_modeling="transformers.models.lfm2_moe.modeling_lfm2_moe",
    notes=("sigmoid-routed experts with an expert bias after one dense layer",))

_LFM3 = TinyFamily(
    "lfm3", "Lfm3ForCausalLM", "Lfm3Config",
    dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
         head_dim=16, max_position_embeddings=4096, intermediate_size=96, conv_L_cache=5,
         sliding_window=8, layer_types=["conv", "sliding_attention", "conv", "full_attention",
                                        "conv", "sliding_attention"],
         use_sandwich_norm=True, use_attention_gate=True, tie_word_embeddings=True),
    hf_modeling="transformers.models.lfm3.modeling_lfm3",
    notes=("sliding_window 8, so the test prompts (up to 70 tokens) cross it; the full "
           "attention layer's proportional RoPE rotates 4 of 8 frequencies",))

_KIMI_LINEAR = TinyFamily(
    "kimi_linear", "KimiLinearForCausalLM", "KimiLinearConfig",
    dict(hidden_size=64, num_hidden_layers=5, max_position_embeddings=4096,
         layer_types=["linear_attention", "full_attention", "linear_attention",
                      "linear_attention", "full_attention"],
         mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
         num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
         linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
         intermediate_size=96, moe_intermediate_size=32, num_local_experts=8,
         num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
         tie_word_embeddings=False),
    redraw=redraw_decay_logs, hf_modeling="transformers.models.kimi_linear.modeling_kimi_linear",
    notes=("KDA + MLA (latent pool) without positions; no MTP layers in the architecture",))

_BAILING_HYBRID = TinyFamily(
    "bailing_hybrid", "BailingHybridForCausalLM", "BailingHybridConfig",
    dict(hidden_size=64, num_hidden_layers=5, max_position_embeddings=4096,
         layer_types=["linear_attention", "full_attention", "linear_attention",
                      "linear_attention", "full_attention"],
         mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"],
         num_attention_heads=4, num_key_value_heads=4, head_dim=8, kv_lora_rank=32,
         q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
         short_conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-5.0,
         intermediate_size=96, moe_intermediate_size=32, num_local_experts=8,
         num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
         num_mtp_layers=0, tie_word_embeddings=False),
    hf_modeling="transformers.models.bailing_hybrid.modeling_bailing_hybrid",
    notes=("KDA + MLA (latent pool) with interleaved RoPE and a head gate; head_dim = "
           "qk_rope_head_dim, since transformers' config rewrites head_dim to it on save",))

_MINIMAX = TinyFamily(
    "minimax", "MiniMaxForCausalLM", "MiniMaxConfig",
    dict(hidden_size=64, num_hidden_layers=5, max_position_embeddings=4096,
         layer_types=["linear_attention", "full_attention", "linear_attention",
                      "linear_attention", "full_attention"],
         num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
         num_local_experts=4, num_experts_per_tok=2, block_size=16,
         full_attn_alpha_factor=1.2, full_attn_beta_factor=0.8, linear_attn_alpha_factor=0.9,
         linear_attn_beta_factor=1.1, mlp_alpha_factor=0.7, mlp_beta_factor=1.3,
         tie_word_embeddings=False),
    redraw=keep_lightning_buffers, hf_modeling="transformers.models.minimax.modeling_minimax",
    notes=("lightning attention blocks of 16 tokens: prompts in the tests cross them",))

_OLMO_HYBRID = TinyFamily(
    "olmo_hybrid", "OlmoHybridForCausalLM", "OlmoHybridConfig",
    dict(hidden_size=64, num_hidden_layers=5, max_position_embeddings=4096,
         layer_types=["linear_attention", "full_attention", "linear_attention",
                      "linear_attention", "full_attention"],
         num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
         linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=16,
         linear_value_head_dim=24, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
         tie_word_embeddings=False),
    hf_modeling="transformers.models.olmo_hybrid.modeling_olmo_hybrid",
    notes=("Gated DeltaNet as Qwen3-Next's (beta up to 2) + post-norm attention with "
           "whole-width q/k norms",))

_MAMBA = TinyFamily(
    "mamba", "MambaForCausalLM", "MambaConfig",
    dict(hidden_size=64, num_hidden_layers=4, state_size=16, expand=2, conv_kernel=4,
         time_step_rank=8, use_bias=True, use_conv_bias=True, residual_in_fp32=True,
         tie_word_embeddings=False),
    redraw=redraw_mamba1, hf_modeling="transformers.models.mamba.modeling_mamba", light=True,
    notes=("pure Mamba1: no attention, so no KV tensors (page bookkeeping only)",))

_FALCON_MAMBA = TinyFamily(
    "falcon_mamba", "FalconMambaForCausalLM", "FalconMambaConfig",
    dict(hidden_size=64, num_hidden_layers=4, state_size=16, expand=2, conv_kernel=4,
         time_step_rank="auto", use_bias=False, use_conv_bias=False, residual_in_fp32=True,
         mixer_rms_eps=1e-5, tie_word_embeddings=True),
    redraw=redraw_mamba1, hf_modeling="transformers.models.falcon_mamba.modeling_falcon_mamba", light=True,
    notes=("Mamba1 with weightless RMSNorms on dt, B and C; dt rank auto = 4",))

# Multimodal wrappers served for their text part (``tools/tiny_wrappers.py``): the text config is
# the family's own tiny one, the towers are tiny and skipped by name on load.
_LFM2_VL = TinyFamily(
    "lfm2_vl", "Lfm2VlForConditionalGeneration", "Lfm2VlConfig", tw.lfm2_vl(_LFM2.config),
    hf_modeling=_LFM2.hf_modeling, text_config_key="text_config",
    notes=("LFM2-VL: SigLIP2 tower and projector skipped; tied at the top level",))
_LFM3_VL = TinyFamily(
    "lfm3_vl", "Lfm3VlForConditionalGeneration", "Lfm3VlConfig", tw.lfm3_vl(_LFM3.config),
    hf_modeling=_LFM3.hf_modeling, text_config_key="text_config")
_NEMOTRON_H_OMNI = TinyFamily(
    "nemotron_h_omni", "NemotronH_Omni_Reasoning_V3", "NemotronH_Omni_Reasoning_V3_Config",
    tw.nemotron_h_omni(_NEMOTRON_H.config),
    hf_modeling=_NEMOTRON_H.hf_modeling, text_config_key="text_config",
    notes=("RADIO vision tower, Parakeet sound encoder and projectors skipped (saved under "
           "their released names); the language model is a NemotronHForCausalLM",))
_NEMOTRON3_5_TRANSCRIBE = TinyFamily(
    "nemotron3_5_transcribe", "Nemotron3_5TranscribeForConditionalGeneration", "Nemotron3_5TranscribeConfig",
    tw.nemotron_transcribe(_NEMOTRON_H.config), hf_modeling=_NEMOTRON_H.hf_modeling,
    text_config_key="text_config", layout_writer=tw.fuse_nemo_experts,
    notes=("saved in NVIDIA's NeMo layout (llm.*, perception.*), routed experts fused as released",))
_MINICPM = dict(zero_centered_norms=True, hf_modeling=_Q35, text_config_key="text_config")
_MINICPMV4_6 = TinyFamily("minicpmv4_6", "MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_6Config",
                          tw.minicpm(), **_MINICPM)
_MINICPMV4_7 = TinyFamily("minicpmv4_7", "MiniCPMV4_7ForConditionalGeneration", "MiniCPMV4_7Config",
                          tw.minicpm(), **_MINICPM)
_MINICPM_OCR = TinyFamily("minicpm_ocr", "MiniCPMOcrForConditionalGeneration", "MiniCPMOcrConfig",
                          tw.minicpm(tie=True), **_MINICPM, notes=("tied at the top level, as released",))
_WRAPPERS = (_LFM2_VL, _LFM3_VL, _NEMOTRON_H_OMNI, _NEMOTRON3_5_TRANSCRIBE, _MINICPMV4_6, _MINICPMV4_7,
             _MINICPM_OCR)

_INKLING = TinyFamily(
    "inkling", "InklingForCausalLM", "InklingTextConfig",
    dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
         head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=8,
         sliding_window_size=8, d_rel=8, rel_extent=24, log_scaling_n_floor=8,
         log_scaling_alpha=0.3, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
         mlp_layer_types=["dense", "sparse", "sparse", "dense"], conv_kernel_size=4,
         intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
         num_experts_per_tok=2, n_shared_experts=2, route_scale=2.0,
         logits_mup_width_multiplier=2.0, max_position_embeddings=4096, tie_word_embeddings=False),
    redraw=redraw_global_scales, hf_modeling="transformers.models.inkling.modeling_inkling",
    notes=("sliding layers (window 8) with other head shapes than the full ones; the relative "
           "bias reaches 24 tokens back and the log scaling starts at position 8, so the test "
           "prompts cross all three",))

_LARA_MINI = TinyFamily(
    "lara_mini", "LaraMiniForCausalLM", "LaraMiniConfig",
    dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
         head_dim=16, max_position_embeddings=4096, sliding_window=8,
         layer_types=["linear_attention", "sliding_attention", "linear_attention",
                      "full_attention", "sliding_attention"],
         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
         linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
         num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
         tie_word_embeddings=False),
    hf_modeling="transformers.models.lara_mini.modeling_lara_mini", light=True,
    notes=("saved as released: GDN projections fused into in_proj, out_norm, fused experts; "
           "sliding_window 8 (RoPE) and one NoPE full-attention layer",))

_RECURRENT_GEMMA = TinyFamily(
    "recurrent_gemma", "RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
    dict(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
         lru_width=64, intermediate_size=192, attention_window_size=8, conv1d_width=4,
         logits_soft_cap=30.0, block_types=["recurrent", "recurrent", "attention"],
         tie_word_embeddings=False),
    zero_centered_norms=True, redraw=redraw_rglru,
    hf_modeling="transformers.models.recurrent_gemma.modeling_recurrent_gemma",
    notes=("RG-LRU layers 0, 1, 3, 4 and local attention (window 8) 2; lru_width = hidden_size "
           "as released (transformers' cached one-token prefill needs it); untied, since a tied "
           "tiny head repeats the input token (test_head_tie checks the tie)",))

_ZAMBA = TinyFamily(
    "zamba", "ZambaForCausalLM", "ZambaConfig",
    dict(hidden_size=64, num_hidden_layers=5, max_position_embeddings=4096,
         layers_block_type=["linear_attention", "hybrid", "linear_attention", "linear_attention",
                            "hybrid"],
         num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, hidden_act="gelu",
         n_mamba_heads=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
         mamba_conv_bias=True, mamba_proj_bias=True, tie_word_embeddings=True),
    redraw=redraw_mamba1, hf_modeling="transformers.models.zamba.modeling_zamba",
    notes=("two Mamba heads with their own dt / B / C; one shared GQA block (head dim 32) "
           "invoked twice, each invocation with its own KV",))

_ZAYA = TinyFamily(
    "zaya", "ZayaForCausalLM", "ZayaConfig",
    dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
         head_dim=16, max_position_embeddings=4096, moe_intermediate_size=32, num_experts=4,
         num_experts_per_tok=1, router_hidden_size=16, cca_time0=2, cca_time1=2,
         sliding_window=8, layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
         tie_word_embeddings=False),
    redraw=redraw_zaya, hf_modeling="transformers.models.zaya.modeling_zaya",
    notes=("CCA attention (conv state on q/k, delayed v, KV) in every layer, sliding window 8 "
           "on the odd ones; top-1 MoE of 4 experts + the skip expert",))

_QWEN4_EXP = TinyFamily(
    "qwen4_exp", "Qwen4ExpForCausalLM", "Qwen4ExpTextConfig",
    dict(q35.MOE, layer_types=["linear_attention", "indexed_attention", "linear_attention",
                               "linear_attention", "indexed_attention"],
         hc_count=3, hc_lowrank=16, ple_layer_ids=[1, 4], ple_embed_dim=32, ngram_size=3,
         heads_per_ngram=2, ngram_vocab_size_base=101, make_ngram_vocab_size_divisible_by=8,
         split_ngram_parts=2, ple_conv_kernel_size=4, indexer_n_heads=16, indexer_kv_heads=1,
         indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4),
    zero_centered_norms=True, hf_modeling="transformers.models.qwen4_exp.modeling_qwen4_exp",
    notes=("indexer blocks of 4 tokens, 2 kept per query (budget 8) plus the partial block: "
           "prompts past 11 tokens attend to a subset; PLE on GDN layers 0 and 3 (3-grams, a "
           "dilated conv reaching 9 tokens back); 3 hyper-connection streams",))

_QWEN4_EXP_VL = TinyFamily(
    "qwen4_exp_vl", "Qwen4ExpForConditionalGeneration", "Qwen4ExpConfig", q35.vl_config(_QWEN4_EXP.config),
    zero_centered_norms=True, hf_modeling=_QWEN4_EXP.hf_modeling, text_config_key="text_config",
    layout_writer=q35.fuse_experts, light=True,
    notes=("the vision-language layout: model.language_model.*, experts fused, the vision "
           "tower skipped",))

_GLM5_NEXT = TinyFamily(
    "glm5_next", "Glm5NextForConditionalGeneration", "Glm5NextConfig", tw.glm5_next(),
    redraw=redraw_glm5_next, text_config_key="text_config",
    hf_modeling="transformers.models.glm5_next.modeling_glm5_next",
    notes=("KDA + MLA over a DSA k-pool indexer's selection, 3 mHC streams, clipped SwiGLUs "
           "(tiny_wrappers.GLM5_NEXT_TEXT); the vision tower is tiny and skipped",))

_INKLING_MM = TinyFamily(
    "inkling_mm", "InklingForConditionalGeneration", "InklingConfig",
    dict(text_config=dict(_INKLING.config), tie_word_embeddings=False,
         vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=4),
         audio_config=dict(n_mel_bins=4, mel_vocab_size=8)),
    redraw=redraw_global_scales, hf_modeling=_INKLING.hf_modeling, text_config_key="text_config",
    notes=("saved in the released layout (model.llm.*, gate / up interleaved); vision and audio "
           "towers skipped",))

_INKLING2 = TinyFamily(
    "inkling2", "Inkling2ForCausalLM", "Inkling2TextConfig", ink2.INKLING2, redraw=redraw_inkling2,
    hf_modeling="transformers.models.inkling2.modeling_inkling2", notes=("see tools/tiny_inkling2.py",))
_INKLING2_LOOP = TinyFamily(
    "inkling2_loop", "Inkling2LoopForCausalLM", "Inkling2LoopTextConfig", ink2.LOOP, redraw=redraw_inkling2,
    hf_modeling="transformers.models.inkling2_loop.modeling_inkling2_loop", notes=("see tools/tiny_inkling2.py",))

TINY_FAMILIES: dict[str, TinyFamily] = {f.name: f for f in (
    *_WRAPPERS,
    _QWEN3_NEXT, _GRANITE, _MAMBA2, _NEMOTRON_H, _BAMBA, _FALCON_H1, _ZAMBA2,
    _QWEN3_5, _QWEN3_5_MOE, _QWEN3_5_VL, _QWEN3_5_MOE_VL, _JAMBA, _LFM2, _LFM2_MOE, _LFM3,
    _KIMI_LINEAR, _BAILING_HYBRID, _MINIMAX, _OLMO_HYBRID, _MAMBA, _FALCON_MAMBA, _ZAMBA,
    _INKLING, _INKLING_MM, _INKLING2, _INKLING2_LOOP, _LARA_MINI, _RECURRENT_GEMMA, _ZAYA,
    _GLM5_NEXT, _QWEN4_EXP, _QWEN4_EXP_VL)}


def get_family(name: str) -> TinyFamily:
    family = TINY_FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown tiny arch {name!r}; expected one of {tuple(TINY_FAMILIES)}")
    return family
