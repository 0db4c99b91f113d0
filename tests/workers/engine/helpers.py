"""Prompt builders and a small LLM factory for engine tests."""
from __future__ import annotations

import random

from workers.llm import LLM
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Stay clear of the special tokens at the end of the tiny vocabulary.
    return [[rng.randrange(3, vocab_size - 8) for _ in range(n)] for n in lengths]


def make_llm(model_dir, **overrides) -> LLM:
    base = {"device": "cpu", "dtype": "float32",
            "cache": {"page_size": 4, "max_kv_tokens": 4096}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return LLM(model=str(model_dir), **base)


def greedy_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate_ids(prompts, [params] * len(prompts))]
