"""transformers as the reference: one prompt at a time, positions and cache passed explicitly."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def hf_model(model_dir: str | Path) -> torch.nn.Module:
    """The checkpoint in transformers' own class of its ``architectures[0]`` (fp32, eval).

    A vision-language checkpoint thus runs its full ``...ForConditionalGeneration`` model
    (text-only inputs), not a text-only reinterpretation of it.
    """
    import transformers

    arch = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(str(model_dir), dtype=torch.float32).eval()


class HFOracle:
    def __init__(self, model_dir: str | Path) -> None:
        self.model = hf_model(model_dir)

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Uncached forward over a whole sequence -> [L, V] float32."""
        x = torch.tensor([ids])
        out = self.model(input_ids=x, position_ids=torch.arange(len(ids))[None], use_cache=False)
        return out.logits[0].float()

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> tuple[object, torch.Tensor]:
        """Cached prefill -> (cache, logits [L, V]). The model builds its own cache (MiniMax's
        is a class of its own)."""
        out = self.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], use_cache=True)
        return out.cache, out.logits[0].float()

    @torch.inference_mode()
    def decode(self, cache: object, token: int, position: int) -> torch.Tensor:
        """One cached step at ``position`` -> logits [V]."""
        out = self.model(
            input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]), cache=cache, use_cache=True
        )
        return out.logits[0, -1].float()
