"""The SGLang keep-slot aliasing scenario: with lazy extra-buffer checkpoints, MTP and the
overlap scheduler, a prefill donated its keep slot to the tree while the in-flight first
verify was still writing the grid-crossing state into it (SGLang's lazy-MTP path, PR
#30437 and the keep-slot aliasing fix after it), so the tree held a state of another depth
under the prefill node.

extra_buffer_lazy + MTP + overlap, a 12-slot Mamba pool pre-filled with unlocked cached
checkpoints (a warm-up batch of other prompts), 40 distinct prompts one token short of a
grid point. Each prompt's prefill checkpoint lands below the grid (6, or 192 / 254 at full
scale) in the batch just before its first verify, and that verify crosses the grid on row
0, so it crosses whatever the acceptance. With the pool full, the non-evicting pending-slot
allocation fails, so the verify writes the crossing state in place into the keep slot that
the prefill result is about to donate: the donation must be refused (guard on) or the tree
ends up with a node holding the state of another depth (guard off).

Passes: (1) "first": the 40 prompts; (2) "second": per prompt, newest first (so surviving
checkpoints are matched before admission evicts them), a follow-up turn (prompt + 2
generated tokens + 1 new token, which matches the grid checkpoint the first verify
produced) and the prompt itself again (which matches its prefill checkpoint, if one was
published). The control is a fresh engine with the prefix cache off, itself checked
against the toy model's analytic greedy continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.sim.harness import Sim, distinct_prompts
from workers.outputs import RequestOutput
from workers.sampling.params import SamplingParams


@dataclass(frozen=True)
class Scale:
    name: str
    page_size: int
    interval: int
    num_draft_tokens: int
    prompt_len: int
    chunked_prefill_size: int = 512
    num_prompts: int = 40
    num_warmup: int = 12
    max_mamba_slots: int = 12
    max_running_requests: int = 4
    max_tokens: int = 8

    @property
    def prefill_target(self) -> int:
        return ((self.prompt_len - 1) // self.page_size) * self.page_size

    @property
    def grid(self) -> int:
        import math

        return math.lcm(self.interval, self.page_size)

    @property
    def crossing(self) -> int:
        return (self.prompt_len // self.grid + 1) * self.grid

    def overrides(self, **extra: Any) -> dict[str, Any]:
        cache = {
            "mamba_strategy": "extra_buffer_lazy",
            "page_size": self.page_size,
            "mamba_track_interval": self.interval,
            "max_mamba_slots": self.max_mamba_slots,
            **extra.pop("cache", {}),
        }
        out = {
            "cache": cache,
            "scheduler": {
                "overlap": True,
                "max_running_requests": self.max_running_requests,
                "chunked_prefill_size": self.chunked_prefill_size,
            },
            "spec": {"method": "mtp", "num_draft_tokens": self.num_draft_tokens},
        }
        for key, value in extra.items():
            out[key] = {**out.get(key, {}), **value}
        return out


# The SGLang repro: grid 8, 2 drafts, 7-token prompts (prefill checkpoint 6, first verify crosses 8).
SGLANG = Scale("sglang", page_size=1, interval=8, num_draft_tokens=2, prompt_len=7)
# Full scale, interval 256, 4 drafts, 255-token prompts. SGLang's "chunk 64" is its kernel
# chunk, which puts the prefill checkpoint on a 64 grid (192); here that grid is the page.
FULL_PAGE64 = Scale("full_page64", page_size=64, interval=256, num_draft_tokens=4, prompt_len=255)
# Full scale with 64-token prefill chunks: the checkpoint (254) sits inside the final chunk.
FULL_CHUNK64 = Scale(
    "full_chunk64", page_size=1, interval=256, num_draft_tokens=4, prompt_len=255, chunked_prefill_size=64
)
# Page 64 and 64-token chunks: the checkpoint (192) ends a non-final chunk and is donated one
# step before the first verify is launched, so nothing can alias; a correctness variant.
FULL_PAGE64_CHUNK64 = Scale(
    "full_page64_chunk64", page_size=64, interval=256, num_draft_tokens=4, prompt_len=255, chunked_prefill_size=64
)


@dataclass
class Passes:
    prompts: list[list[int]]
    passes: dict[str, list[list[int]]] = field(default_factory=dict)  # name -> prompts
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)  # harness summary after each

    def tokens(self, name: str) -> list[list[int]]:
        return [o.token_ids for o in self.outputs[name]]


def params(scale: Scale) -> SamplingParams:
    return SamplingParams(max_tokens=scale.max_tokens, temperature=0.0, ignore_eos=True)


def workload(scale: Scale, sim: Sim) -> tuple[list[list[int]], Passes]:
    """(warm-up prompts, the scenario's passes) for ``scale``."""
    v = sim.vocab
    warm = distinct_prompts(scale.num_warmup, scale.prompt_len, v, seed=1)
    prompts = distinct_prompts(scale.num_prompts, scale.prompt_len, v, seed=2, first_token_base=scale.num_warmup)
    expected = [v.greedy(p, 2) for p in prompts]
    follow = [p + e + [v.low + (i * 7) % (v.high - v.low)] for i, (p, e) in enumerate(zip(prompts, expected))]
    second = [q for f, p in zip(follow[::-1], prompts[::-1]) for q in (f, p)]
    return warm, Passes(prompts, {"first": prompts, "second": second})


def run(sim: Sim, scale: Scale, warm: bool = True) -> Passes:
    warmup, passes = workload(scale, sim)
    if warm:
        sim.run(warmup, params(scale))
        passes.summaries["warmup"] = sim.summary()
    for name, prompts in passes.passes.items():
        passes.outputs[name] = sim.run(prompts, params(scale))
        passes.summaries[name] = sim.summary()
    return passes
