"""Inkling's multimodal checkpoint (``InklingForConditionalGeneration``, thinkingmachines/Inkling):
the text model served as ``InklingForCausalLM``, the vision and audio towers skipped by name.

The layout is the released one, which transformers 5.24 also writes with ``save_pretrained``
(its load converts from it): ``model.llm.{embed, embed_norm, norm, unembed}``, per layer
``attn.{wq_du, wk_dv, wv_dv, wr_du, wo_ud}`` (q / k / v / r / o projections), ``attn.{q,k}_norm``,
``attn.{k,v}_sconv.weight``, ``attn.rel_logits_proj.proj``, ``attn_norm`` / ``mlp_norm``,
``attn_sconv`` / ``mlp_sconv``; the dense MLP's ``w13_dn`` and the experts' ``w13_weight`` /
``shared_experts.shared_w13_weight`` hold gate and up *interleaved* by row (gate row i at 2i,
up row i at 2i + 1), ``w2_md`` / ``w2_weight`` / ``shared_w2_weight`` the down projections,
``gate.bias`` the score-correction bias. transformers' own names (``model.language_model.*``,
top-level ``lm_head``) load too. ``model.visual.*`` / ``model.audio.*`` (or
``model.vision_tower.*`` / ``model.audio_tower.*``) are skipped; image and audio inputs are
not served (``is_vl_checkpoint`` True, ``serves_images`` False).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from workers.models.inkling import InklingForCausalLM
from workers.models.wrapped_text import WrappedText

_LLM = "model.llm."
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_norm.weight": "model.embed_tokens.embed_norm.weight",
    "norm.weight": "model.norm.weight",
    "unembed.weight": "lm_head.weight",
}
_LAYER_RENAMES = tuple(
    (re.compile(src), dst)
    for src, dst in (
        (r"\.attn\.wq_du\.", ".self_attn.q_proj."),
        (r"\.attn\.wk_dv\.", ".self_attn.k_proj."),
        (r"\.attn\.wv_dv\.", ".self_attn.v_proj."),
        (r"\.attn\.wr_du\.", ".self_attn.r_proj."),
        (r"\.attn\.wo_ud\.", ".self_attn.o_proj."),
        (r"\.attn\.(q_norm|k_norm|rel_logits_proj)\.", r".self_attn.\1."),
        (r"\.attn\.(k_sconv|v_sconv)\.weight$", r".self_attn.\1.conv1d.weight"),
        (r"\.(attn_sconv|mlp_sconv)\.weight$", r".\1.conv1d.weight"),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.mlp_norm\.", ".post_attention_layernorm."),
        (r"\.mlp\.w2_md\.weight$", ".mlp.down_proj.weight"),
        (r"\.mlp\.gate\.bias$", ".mlp.gate.e_score_correction_bias"),
        (r"\.mlp\.experts\.w2_weight$", ".mlp.experts.down_proj"),
        (r"\.mlp\.shared_experts\.shared_w2_weight$", ".mlp.shared_experts.down_proj"),
        (r"(\.layers\.\d+)\.attn\.", r"\1.self_attn."),  # the rest of attn.* (Inkling2's)
    )
)


def _deinterleave(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 2i (gate) and 2i + 1 (up) of ``dim`` -> (gate, up)."""
    if t.shape[dim] % 2:
        raise ValueError(f"an interleaved gate/up tensor has an odd size {t.shape[dim]} along dim {dim}")
    return t.unflatten(dim, (-1, 2)).unbind(dim + 1)


def released_names(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One released tensor -> the text model's names (split where gate / up are interleaved)."""
    if not name.startswith(_LLM):
        yield name, t
        return
    rest = name[len(_LLM) :]
    if rest in _TOP:
        yield _TOP[rest], t
        return
    name = "model." + rest
    for pattern, dst in _LAYER_RENAMES:
        name = pattern.sub(dst, name)
    if name.endswith(".mlp.w13_dn.weight"):
        gate, up = _deinterleave(t, 0)
        base = name[: -len("w13_dn.weight")]
        yield f"{base}gate_proj.weight", gate
        yield f"{base}up_proj.weight", up
    elif name.endswith(".mlp.experts.w13_weight"):
        yield name[: -len("w13_weight")] + "gate_up_proj", torch.cat(_deinterleave(t, 1), dim=1)
    elif name.endswith(".mlp.shared_experts.shared_w13_weight"):
        gate, up = _deinterleave(t, 1)
        base = name[: -len("shared_w13_weight")]
        yield f"{base}gate_proj", gate
        yield f"{base}up_proj", up
    else:
        yield name, t


class InklingForConditionalGeneration(WrappedText, InklingForCausalLM):
    text_model_types = ("inkling_text",)
    text_renames = (("model.language_model.", "model."),)
    tower_prefixes = ("model.visual.", "model.audio.", "model.vision_tower.", "model.audio_tower.")

    def text_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().text_tensors(weights):
            yield from released_names(name, tensor)
