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
        is a class of its own), except where it keeps its state on its modules (below)."""
        if _module_states(self.model):
            return self._prefill_module_states(ids)
        out = self.model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], use_cache=True)
        return out.cache, out.logits[0].float()

    @torch.inference_mode()
    def decode(self, cache: object, token: int, position: int) -> torch.Tensor:
        """One cached step at ``position`` -> logits [V]."""
        if isinstance(cache, ModuleStateCache):
            _restore(self.model, cache.states)
            cache.states = None
        out = self.model(
            input_ids=torch.tensor([[token]]),
            position_ids=torch.tensor([[position]]),
            cache=cache.cache if isinstance(cache, ModuleStateCache) else cache,
            use_cache=True,
        )
        if isinstance(cache, ModuleStateCache):
            cache.states = _save(self.model)
        return out.logits[0, -1].float()

    def _prefill_module_states(self, ids: list[int]) -> tuple[object, torch.Tensor]:
        from transformers import DynamicCache

        self.model._setup_cache(self.model.config, 1, "cpu", torch.float32)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], cache=cache, use_cache=True
        )
        return ModuleStateCache(cache, _save(self.model)), out.logits[0].float()


# transformers' RecurrentGemma keeps its recurrent and conv states on its modules (not in the
# cache it is passed, and it returns no cache): the oracle saves them per sequence.
_STATE_ATTRS = ("conv1d_state", "recurrent_states")


class ModuleStateCache:
    def __init__(self, cache: object, states: dict) -> None:
        self.cache, self.states = cache, states


def _module_states(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    return [(m, a) for m in model.modules() for a in _STATE_ATTRS if hasattr(m, a)]


def _save(model: torch.nn.Module) -> dict:
    return {(id(m), a): getattr(m, a) for m, a in _module_states(model)}


def _restore(model: torch.nn.Module, states: dict) -> None:
    for m, a in _module_states(model):
        setattr(m, a, states[(id(m), a)])
