"""The text part of multimodal checkpoints whose language model is a family served here.

Each class is its text family's class with ``WrappedText`` in front: the config served is
``text_config`` (its ``model_type`` must be the family's, else a ValueError naming it), the
language model's tensors are renamed from the wrapper's namespace to the family's, and the
towers and projectors beside it (vision, audio) are skipped by name; a tensor that is
neither is passed on, so an unknown or missing text tensor is still an error. Images and
audio are not served: a vision wrapper reports ``is_vl_checkpoint`` True and
``serves_images`` False (the HTTP layer answers an image part with a 400 naming the part),
and audio parts are refused by type there.

Checked against the wrapper's transformers 5.24 class on text-only input, which runs the
language model on the embeddings of the ids and its head, with nothing else in between:

- ``Lfm2VlForConditionalGeneration`` (LFM2-VL, text ``lfm2``), ``Lfm3VlForConditionalGeneration``
  (text ``lfm3``): ``model.language_model.*``, top-level ``lm_head``, tied by the top-level
  ``tie_word_embeddings`` (LFM2-VL's legacy ``tie_embedding`` is read by its config);
  ``model.vision_tower.*`` / ``model.multi_modal_projector.*`` skipped. An ``lfm2_moe`` text
  model is refused (``text_config.model_type``).
- ``MiniCPMV4_6ForConditionalGeneration``, ``MiniCPMV4_7ForConditionalGeneration``,
  ``MiniCPMOcrForConditionalGeneration`` (text ``qwen3_5_text``): as Qwen3.5-VL's layout, with
  ``model.vision_tower.*`` / ``model.merger.*`` skipped. MiniCPM-V 4.7's canvas M-RoPE only
  moves the positions of image tokens; for text they are the token positions.
- ``NemotronH_Omni_Reasoning_V3`` (Nemotron 3 Nano Omni, text ``nemotron_h``): the language
  model is a whole ``NemotronHForCausalLM`` under ``language_model.`` (``backbone.*``, its
  own ``lm_head``, never tied; ``language_model.mtp.*`` is kept aside as Nemotron-H's
  ``mtp.*``); the RADIO vision tower, the Parakeet sound encoder and their projectors, under
  the released names ``save_pretrained`` also writes (``vision_model.*``, ``mlp1.*``,
  ``vision_projector.*``, ``sound_encoder.*``, ``sound_projection.*``), are skipped.
- ``Nemotron3_5TranscribeForConditionalGeneration`` (text ``nemotron_h``): NVIDIA's NeMo
  layout, which transformers also saves (``llm.model.{embed_tokens,layers,norm}``,
  ``llm.lm_head``, Mamba2 ``mixer._fp32_params.*``, routed experts per expert or fused
  ``experts.gate_and_up_projs`` [E, H, I] / ``down_projs`` [E, I, H]). The speech,
  diarization and word-timestamp towers (``perception.*``, ``ctc_timestamp.*``) and NeMo's
  ``llm.mtp.*`` (which transformers does not load either) are skipped. No vision tower, so
  ``is_vl_checkpoint`` is False. The audio placeholder id past the vocabulary (embedded as
  token 0 by transformers, then replaced by audio) is refused as an out-of-vocabulary id.

Not served: ``JevForDecision`` (``models/jev``) has no language-model head, only a decision
head scoring labels at marked positions (and its config may make attention non-causal).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from workers.models.lfm2 import Lfm2ForCausalLM
from workers.models.lfm3 import Lfm3ForCausalLM
from workers.models.nemotron_h import NemotronHForCausalLM
from workers.models.qwen3_5 import Qwen3_5ForCausalLM

Renames = tuple[tuple[str, str], ...]


class WrappedText:
    """Mixin (before the family's class): ``text_config``, renames, towers skipped by name."""

    is_vl_checkpoint = True
    text_model_types: tuple[str, ...] = ()
    text_renames: Renames = ()  # checkpoint prefix -> the family's (first match)
    tower_prefixes: tuple[str, ...] = ()  # prefixes of the tensors not served
    num_tower_tensors_skipped = 0  # set by the last load

    @classmethod
    def language_config(cls, hf_config: Any) -> Any:
        text = getattr(hf_config, "text_config", None)
        if text is None:
            raise ValueError(f"{cls.__name__} config has no text_config")
        kind = getattr(text, "model_type", None)
        if kind not in cls.text_model_types:
            raise ValueError(
                f"text_config.model_type={kind!r} is not served by {cls.__name__} (only {list(cls.text_model_types)})"
            )
        return text

    def text_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        self.num_tower_tensors_skipped = 0
        for name, tensor in weights:
            if name.startswith(self.tower_prefixes):
                self.num_tower_tensors_skipped += 1
                continue
            for src, dst in self.text_renames:
                if name.startswith(src):
                    name = dst + name[len(src) :]
                    break
            yield name, tensor

    def checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return super().checkpoint_tensors(self.text_tensors(weights))  # type: ignore[misc]


_LANGUAGE_MODEL = (("model.language_model.", "model."),)


class Lfm2VlForConditionalGeneration(WrappedText, Lfm2ForCausalLM):
    text_model_types = ("lfm2",)
    text_renames = _LANGUAGE_MODEL
    tower_prefixes = ("model.vision_tower.", "model.multi_modal_projector.")


class Lfm3VlForConditionalGeneration(WrappedText, Lfm3ForCausalLM):
    text_model_types = ("lfm3",)
    text_renames = _LANGUAGE_MODEL
    tower_prefixes = ("model.vision_tower.", "model.multi_modal_projector.")


class MiniCPMV4_6ForConditionalGeneration(WrappedText, Qwen3_5ForCausalLM):
    text_model_types = ("qwen3_5_text",)
    text_renames = _LANGUAGE_MODEL
    tower_prefixes = ("model.vision_tower.", "model.merger.")


class MiniCPMV4_7ForConditionalGeneration(MiniCPMV4_6ForConditionalGeneration):
    pass


class MiniCPMOcrForConditionalGeneration(MiniCPMV4_6ForConditionalGeneration):
    pass


class NemotronHOmniForConditionalGeneration(WrappedText, NemotronHForCausalLM):
    """``NemotronH_Omni_Reasoning_V3`` in the registry (transformers' class name)."""

    text_model_types = ("nemotron_h",)
    text_renames = (
        ("language_model.backbone.", "backbone."),
        ("language_model.lm_head.", "lm_head."),
        ("language_model.mtp.", "mtp."),
    )
    tower_prefixes = ("vision_model.", "vision_projector.", "mlp1.", "sound_encoder.", "sound_projection.")


_NEMO_EXPERTS = {".mixer.experts.gate_and_up_projs": "up_proj", ".mixer.experts.down_projs": "down_proj"}


class Nemotron3_5TranscribeForConditionalGeneration(WrappedText, NemotronHForCausalLM):
    is_vl_checkpoint = False  # an audio tower, no vision tower
    text_model_types = ("nemotron_h",)
    text_renames = (
        ("llm.model.embed_tokens.", "backbone.embeddings."),
        ("llm.model.norm.", "backbone.norm_f."),
        ("llm.model.layers.", "backbone.layers."),
        ("llm.lm_head.", "lm_head."),
    )
    tower_prefixes = ("perception.", "ctc_timestamp.", "llm.mtp.")

    def text_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """NeMo's names within a layer too: ``_fp32_params``, fused transposed experts, and no
        TransformerEngine ``_extra_state`` (skipped, as transformers does)."""
        for name, tensor in super().text_tensors(weights):
            if name.endswith("._extra_state"):
                self.num_tower_tensors_skipped += 1
                continue
            name = name.replace(".mixer._fp32_params.", ".mixer.")
            fused = next((suffix for suffix in _NEMO_EXPERTS if name.endswith(suffix)), None)
            if fused is None:
                yield name, tensor
                continue
            if tensor.dim() != 3:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}; expected [experts, in, out]")
            prefix = name[: -len(fused)] + ".mixer.experts."
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.{_NEMO_EXPERTS[fused]}.weight", tensor[e].t()
