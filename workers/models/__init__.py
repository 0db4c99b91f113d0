"""Model registry: HF ``architectures[0]`` name -> model class.

Every class implements the interface described in ``workers/models/base.py``:
``cls(hf_config, dtype, device)``, ``cache_spec()``, ``forward(batch, pools)``,
``compute_logits(hidden)``, ``load_weights(weights)`` and ``mtp_weights``.
"""

from __future__ import annotations

from workers.models.bailing_hybrid import BailingHybridForCausalLM
from workers.models.bamba import BambaForCausalLM
from workers.models.base import HybridForCausalLM
from workers.models.falcon_h1 import FalconH1ForCausalLM
from workers.models.glm5_next import Glm5NextForConditionalGeneration
from workers.models.granite_hybrid import GraniteMoeHybridForCausalLM
from workers.models.inkling import InklingForCausalLM
from workers.models.inkling2 import Inkling2ForCausalLM
from workers.models.inkling2_loop import Inkling2LoopForCausalLM
from workers.models.inkling_mm import InklingForConditionalGeneration
from workers.models.jamba import JambaForCausalLM
from workers.models.kimi_linear import KimiLinearForCausalLM
from workers.models.lara_mini import LaraMiniForCausalLM
from workers.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from workers.models.lfm3 import Lfm3ForCausalLM
from workers.models.mamba1_lm import FalconMambaForCausalLM, MambaForCausalLM
from workers.models.mamba2_lm import Mamba2ForCausalLM
from workers.models.minimax import MiniMaxForCausalLM
from workers.models.nemotron_h import NemotronHForCausalLM
from workers.models.olmo_hybrid import OlmoHybridForCausalLM
from workers.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
)
from workers.models.qwen3_next import Qwen3NextForCausalLM
from workers.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration
from workers.models.recurrent_gemma import RecurrentGemmaForCausalLM
from workers.models.wrapped_text import (
    Lfm2VlForConditionalGeneration,
    Lfm3VlForConditionalGeneration,
    MiniCPMOcrForConditionalGeneration,
    MiniCPMV4_6ForConditionalGeneration,
    MiniCPMV4_7ForConditionalGeneration,
    Nemotron3_5TranscribeForConditionalGeneration,
    NemotronHOmniForConditionalGeneration,
)
from workers.models.zamba import ZambaForCausalLM
from workers.models.zamba2 import Zamba2ForCausalLM
from workers.models.zaya import ZayaForCausalLM

SUPPORTED_ARCHITECTURES: dict[str, type[HybridForCausalLM]] = {
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    # Qwen3.5 and Qwen3.6 (same architectures): text and vision-language checkpoints
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "Zamba2ForCausalLM": Zamba2ForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "BailingHybridForCausalLM": BailingHybridForCausalLM,
    "MiniMaxForCausalLM": MiniMaxForCausalLM,
    "OlmoHybridForCausalLM": OlmoHybridForCausalLM,
    "LaraMiniForCausalLM": LaraMiniForCausalLM,
    "RecurrentGemmaForCausalLM": RecurrentGemmaForCausalLM,
    "InklingForCausalLM": InklingForCausalLM,
    "InklingForConditionalGeneration": InklingForConditionalGeneration,  # the text part
    "Inkling2ForCausalLM": Inkling2ForCausalLM,
    "Inkling2LoopForCausalLM": Inkling2LoopForCausalLM,
    "Qwen4ExpForCausalLM": Qwen4ExpForCausalLM,
    "Qwen4ExpForConditionalGeneration": Qwen4ExpForConditionalGeneration,  # the text part
    # multimodal wrappers: the text part served, towers skipped (workers/models/wrapped_text.py)
    "Lfm2VlForConditionalGeneration": Lfm2VlForConditionalGeneration,
    "Lfm3VlForConditionalGeneration": Lfm3VlForConditionalGeneration,
    "NemotronH_Omni_Reasoning_V3": NemotronHOmniForConditionalGeneration,
    "Nemotron3_5TranscribeForConditionalGeneration": Nemotron3_5TranscribeForConditionalGeneration,
    "MiniCPMV4_6ForConditionalGeneration": MiniCPMV4_6ForConditionalGeneration,
    "MiniCPMV4_7ForConditionalGeneration": MiniCPMV4_7ForConditionalGeneration,
    "MiniCPMOcrForConditionalGeneration": MiniCPMOcrForConditionalGeneration,
    "MambaForCausalLM": MambaForCausalLM,
    "FalconMambaForCausalLM": FalconMambaForCausalLM,
    "ZambaForCausalLM": ZambaForCausalLM,
    "ZayaForCausalLM": ZayaForCausalLM,
    "Glm5NextForConditionalGeneration": Glm5NextForConditionalGeneration,  # the text part
}


def get_model_class(name: str) -> type[HybridForCausalLM]:
    cls = SUPPORTED_ARCHITECTURES.get(name)
    if cls is None:
        raise ValueError(f"unsupported architecture {name!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    return cls


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HybridForCausalLM",
    "get_model_class",
    "Qwen3NextForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
]
