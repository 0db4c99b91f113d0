"""The tiers' multi-turn case on one engine (``python -m cluster.bench.tiers --multi-turn``)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from workers.llm import LLM
from workers.sampling.params import SamplingParams


def multi_turn_case(model: Path, strategy: str, host: bool, seed: int = 21) -> dict[str, Any]:
    """The issue's case on one engine: 24 slots, 4 running, 20 conversations over 5 system
    prompts; how many turn-2 prompts resume from (at least) their turn-1 prompt."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    cache: dict[str, Any] = {
        "page_size": 4,
        "max_kv_tokens": 4096,
        "max_mamba_slots": 24,
        "mamba_strategy": strategy,
        "mamba_track_interval": 16,
    }
    if host:
        cache.update(host_mamba_slots=96, host_kv_tokens=4096)
    llm = LLM(model=str(model), device="cpu", dtype="float32", cache=cache, scheduler={"max_running_requests": 4})
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    systems = [draw(24) for _ in range(5)]
    turn1 = [systems[i % 5] + draw(6 + i % 7) for i in range(20)]
    outs1 = llm.generate_ids(turn1, [params] * 20)
    turn2 = [p + o.token_ids + draw(4) for p, o in zip(turn1, outs1)]
    outs2 = llm.generate_ids(turn2, [params] * 20)
    hits = sum(o.cached_tokens >= (len(p) - 1) // 4 * 4 for p, o in zip(turn1, outs2))
    return {
        "strategy": strategy,
        "host_tier": host,
        "turn2_hits": hits,
        "of": 20,
        "hits_by_tier": dict(llm.stats()["hybridserve_cache_hits_total"]),
    }
