"""Everything inside one TP group: engine, scheduler, caches, model runner, models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.sampling.params import SamplingParams

if TYPE_CHECKING:
    from workers.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from workers.llm import LLM

        return LLM
    raise AttributeError(name)
