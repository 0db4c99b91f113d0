"""Qwen3.5 / Qwen3.6: dense (``qwen3_5``) and MoE (``qwen3_5_moe``), text and VL checkpoints.

The math is Qwen3-Next's (``qwen3_next.py``: zero-centred RMSNorms, Gated DeltaNet,
gated attention with zero-centred q/k norms and partial RoPE, the same MTP head); what
differs is all this file holds:

- the GDN projections are four unfused ones (``SplitGatedDeltaNet``);
- dense: every layer has a SwiGLU ``mlp`` of ``intermediate_size``. MoE: every layer is an
  MoE (softmax top-k, always renormalised, plus the sigmoid-gated shared expert); the
  Qwen3-Next fields that would say otherwise (``decoder_sparse_step``, ``mlp_only_layers``,
  ``norm_topk_prob``) are refused when they ask for another rule. Experts load from the
  per-expert or the fused (``experts.gate_up_proj`` / ``down_proj``) layout;
- RoPE: ``rope_parameters`` carries ``mrope_section`` / ``mrope_interleaved``. For text the
  temporal, height and width positions are all the token position, so multimodal RoPE
  (interleaved or not, any sections) equals plain RoPE on ``partial_rotary_factor`` of
  ``head_dim``: that is what is computed;
- ``...ForConditionalGeneration`` checkpoints: the config is ``text_config`` (tied
  embeddings at the top level), the language model lives under
  ``model.language_model.*`` next to ``lm_head`` and ``mtp.*``, and the vision tower
  (``model.visual.*``) is skipped by name: ``is_vl_checkpoint`` is True and
  ``serves_images`` False, so image inputs must be refused by the caller.

Config fields that would change the math and are not implemented are refused, named:
``attn_output_gate=False``, ``layer_scale``, a ``mamba_ssm_dtype`` other than float32 (the
recurrent state is kept in float32), and, when speculating, ``mtp_use_dedicated_embeddings``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from workers.models.gated_deltanet import SplitGatedDeltaNet
from workers.models.layers import DenseMLP
from workers.models.moe import unfuse_expert_tensors
from workers.models.qwen3_next import Qwen3NextForCausalLM, qwen_moe

LANGUAGE_MODEL_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
_SSM_DTYPES = (None, "float32")


def _field(cfg: Any, name: str) -> Any:
    """A config field as given, or None (transformers turns a dropped field into an AttributeError)."""
    value = getattr(cfg, name, None)
    return None if isinstance(value, BaseException) else value


def refuse_unimplemented(cfg: Any, moe: bool) -> None:
    """ValueError naming the first config field whose value asks for math not implemented here."""
    if _field(cfg, "attn_output_gate") is False:
        raise ValueError(
            "attn_output_gate=False is not supported (Qwen3.5 attention always applies its sigmoid output gate)"
        )
    if _field(cfg, "layer_scale"):
        raise ValueError(f"layer_scale={_field(cfg, 'layer_scale')!r} (per-layer residual scales) is not supported")
    if _field(cfg, "mamba_ssm_dtype") not in _SSM_DTYPES:
        raise ValueError(
            f"mamba_ssm_dtype={_field(cfg, 'mamba_ssm_dtype')!r} is not supported; the "
            "recurrent state is kept in float32"
        )
    if not moe:
        return
    if _field(cfg, "decoder_sparse_step") not in (None, 1):
        raise ValueError(
            f"decoder_sparse_step={cfg.decoder_sparse_step} is not supported (every Qwen3.5-MoE layer is sparse)"
        )
    if _field(cfg, "mlp_only_layers"):
        raise ValueError(f"mlp_only_layers={cfg.mlp_only_layers} is not supported (every Qwen3.5-MoE layer is sparse)")
    if _field(cfg, "norm_topk_prob") is False:
        raise ValueError("norm_topk_prob=False is not supported (Qwen3.5-MoE renormalises the top-k routing weights)")


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    gdn_class = SplitGatedDeltaNet
    is_moe = False

    @classmethod
    def validate_config(cls, cfg: Any) -> None:
        super().validate_config(cfg)
        refuse_unimplemented(cfg, cls.is_moe)

    @classmethod
    def build_ffn(cls, cfg: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if cls.is_moe:
            return qwen_moe(cfg, dtype, norm_topk_prob=True)
        return DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    @classmethod
    def build_mtp_ffn(cls, cfg: Any, moe: bool, dtype: torch.dtype) -> nn.Module:
        return cls.build_ffn(cfg, 0, dtype)  # the family's own (vLLM / SGLang read it so)

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``model.language_model.*`` -> ``model.*`` (as transformers maps it); fused experts split."""
        renamed = (
            (("model." + n[len(LANGUAGE_MODEL_PREFIX) :]) if n.startswith(LANGUAGE_MODEL_PREFIX) else n, t)
            for n, t in weights
        )
        return unfuse_expert_tensors(renamed)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    is_moe = True


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text part of a Qwen3.5 vision-language checkpoint (see the module docstring)."""

    is_vl_checkpoint = True
    num_vision_tensors_skipped = 0  # set by the last load

    @classmethod
    def language_config(cls, hf_config: Any) -> Any:
        text = getattr(hf_config, "text_config", None)
        if text is None:
            raise ValueError(f"{cls.__name__} config has no text_config")
        return text

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        self.num_vision_tensors_skipped = 0

        def text_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(VISION_PREFIX):
                    self.num_vision_tensors_skipped += 1
                    continue
                yield name, tensor

        return super().checkpoint_tensors(text_only())


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    is_moe = True
