"""Tiny Inkling2 / Inkling2-Loop configs for the registry (``tiny_registry``).

Both are saved by transformers' own classes, which write the released layout. What they
exercise: blocks of 2 layers, sliding window 8 (shorter than the test prompts), a relative
bias reaching 24 tokens back, the log scaling from position 8, q / k and relative-state clips,
the experts' softcaps and the logit cap set low enough to bind. The head is not padded
(``unpadded_vocab_size`` = the vocab): an unpadded head is the config variants' job, since
the engine's prompts may hold every token id. The loop model runs layers 2-5 (a sliding and a
full layer in each of two blocks) 3 times, so its messages read a completed block and the last
hidden state; its MoE keeps all 4 of its experts, as with top-k routing bf16 rounding flips
enough choices over its 15 layer invocations that even transformers' bf16 run agrees with its
fp32 argmax on about a fifth of the tokens (``inkling2`` tests the choice).
"""

from __future__ import annotations

from typing import Any

BASE: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=8,
    d_rel=8, rel_extent=24, log_scaling_n_floor=8, log_scaling_alpha=0.3, conv_kernel_size=4,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, route_scale=2.0,
    n_layers_per_attn_res_block=2, qk_l2_clip_threshold=3.0, rel_l2_clip_threshold=1.5,
    mlp_gate_softcap=1.0, mlp_up_softcap=2.0, final_logit_softcapping=3.0,
    unpadded_vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip

INKLING2 = dict(
    BASE, num_hidden_layers=5, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"]
)
LOOP = dict(
    BASE, num_hidden_layers=7, layer_types=["hybrid_sliding", "hybrid"] * 3 + ["hybrid"],
    loop_layer_index_start=2, loop_layer_index_end=6, loop_num_passes=3, loop_gate_rank=8,
    n_routed_experts=4, num_experts_per_tok=4,
)  # fmt: skip
