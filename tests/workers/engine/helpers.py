"""Prompt builders and a small LLM factory for engine tests."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from workers.llm import LLM
from workers.sampling.params import SamplingParams
from workers.spec.drafter import MtpDrafter

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Stay clear of the special tokens at the end of the tiny vocabulary.
    return [[rng.randrange(3, vocab_size - 8) for _ in range(n)] for n in lengths]


def make_llm(model_dir, **overrides) -> LLM:
    base = {"device": "cpu", "dtype": "float32", "cache": {"page_size": 4, "max_kv_tokens": 4096}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return LLM(model=str(model_dir), **base)


def assert_no_leaks(llm):
    e = llm.engine
    assert not e.requests and not e.scheduler.has_work()
    counts = e.pool_counts()
    assert counts["kv_pages_free"] + counts["kv_pages_cached"] == counts["kv_pages_usable"]
    assert counts["mamba_slots_free"] + counts["mamba_slots_cached"] == counts["mamba_slots_usable"]
    assert e.check_invariants() == []
    e.flush_cache()
    counts = e.pool_counts()
    assert counts["kv_pages_free"] == counts["kv_pages_usable"]
    assert counts["mamba_slots_free"] == counts["mamba_slots_usable"]


def greedy_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate_ids(prompts, [params] * len(prompts))]


class OracleDrafts:
    """Replaces the MTP head's drafts by the expected continuation with every third draft
    corrupted (``corrupt``), so that verifies accept 0..k drafts: ``engine`` and
    ``expected`` (prompt tuple -> prompt + expected output) are set by the test."""

    def __init__(self, monkeypatch, corrupt: Callable[[int], int], filler: int = 1) -> None:
        self.engine = None
        self.expected: dict[tuple[int, ...], list[int]] = {}
        original = MtpDrafter._chain
        oracle = self

        def chain(drafter, spans, hidden, last_pos):
            original(drafter, spans, hidden, last_pos)
            for span, t in zip(spans, last_pos):
                req = oracle.engine.outputs.requests.get(span.request_id)
                full = oracle.expected.get(tuple(req.prompt_token_ids)) if req is not None else None
                if full is None:
                    continue
                drafts = [full[t + 2 + j] if t + 2 + j < len(full) else filler for j in range(drafter.k)]
                drafts[(t + 1) % 3] = corrupt(drafts[(t + 1) % 3])
                drafter.draft_tokens[span.live_slot] = torch.tensor(drafts)

        monkeypatch.setattr(MtpDrafter, "_chain", chain)

    def expect(self, engine, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.engine = engine
        self.expected = {tuple(p): p + e for p, e in zip(prompts, outputs)}
