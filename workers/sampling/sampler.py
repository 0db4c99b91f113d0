"""Sampling from logits rows: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Rows with a seed draw from their own ``torch.Generator`` so a seeded request's tokens do
not depend on what else is in the batch. No device sync happens here: results stay
tensors until the engine's one read per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.sampling.inputs import RowFilters
from workers.sampling.params import SamplingParams
from workers.sampling.processors import draw, filter_rows


@dataclass(frozen=True)
class SampleResult:
    token_ids: torch.Tensor  # int64 [N]
    logprobs: torch.Tensor | None  # float32 [N] chosen-token logprob (if any row asked)
    top_ids: torch.Tensor | None  # int64 [N, max_k]
    top_logprobs: torch.Tensor | None  # float32 [N, max_k]


class GeneratorBank:
    """One generator per seeded request, keyed by the request's engine handle (never the
    caller's id, which may be reused); one shared for the rest. The engine re-seeds a
    request's generator before each draw (``workers.sampling.seeded``); ``sample`` draws
    from it as it stands."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.shared = torch.Generator(device=device)
        self.shared.manual_seed(seed)
        self._per_request: dict[int, torch.Generator] = {}

    def get(self, handle: int, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.shared
        gen = self._per_request.get(handle)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._per_request[handle] = gen
        return gen

    def drop(self, handle: int) -> None:
        self._per_request.pop(handle, None)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask one row [V] to -inf outside top-k and the top-p nucleus."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token if the mass before it is < top_p; the first token is always kept
        # (a top_p that rounds to 0 in float32 would otherwise mask every token).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> SampleResult:
    """logits: float32 [N, V], one row per request; one params / generator per row.

    The plain sampler (temperature, top-k, top-p, min-p) batched over rows, with the
    chosen-token and top logprobs when a row asks; the engine's sampler
    (``workers.sampling.decide``) adds the logits processors in front of the same filters.
    """
    greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
    best = torch.argmax(logits, dim=-1)
    if bool(greedy.all()):
        token_ids = best
    else:
        filters = RowFilters(
            greedy=greedy,
            temperature=torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=logits.device),
            top_k=torch.tensor([p.effective_top_k for p in params], device=logits.device),
            top_p=torch.tensor([p.top_p for p in params], device=logits.device),
            min_p=torch.tensor([p.min_p for p in params], device=logits.device),
        )
        probs = torch.softmax(filter_rows(logits.float(), filters), dim=-1)
        shared = next((g for g, p in zip(generators, params) if p.seed is None), None)
        seeded = [(i, g, None) for i, (g, p) in enumerate(zip(generators, params)) if p.seed is not None]
        token_ids = torch.where(greedy, best, draw(probs, shared, seeded))
    max_k = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    if max_k is None:
        return SampleResult(token_ids, None, None, None)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).view(-1)
    top = torch.topk(logprobs, max(max_k, 1), dim=-1)
    return SampleResult(token_ids, chosen, top.indices, top.values)
