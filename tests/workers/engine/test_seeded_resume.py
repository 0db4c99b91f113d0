"""Seeded sampling resumes: a request re-run as its prompt plus its first k outputs (same
seed, the remaining max_tokens) continues with the undisturbed run's tokens, with and
without MTP speculation and overlap; speculation does not change seeded tokens either."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams

N = 12
P = SamplingParams(max_tokens=N, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True)
SPEC = {"method": "mtp", "num_draft_tokens": 3}
VARIANTS = {
    "plain": {"scheduler": {"overlap": False}},
    "overlap": {"scheduler": {"overlap": True}},
    "spec": {"scheduler": {"overlap": False}, "spec": SPEC},
    "spec_overlap": {"scheduler": {"overlap": True}, "spec": SPEC},
}


def run(llm, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate_ids(prompts, params)]


@pytest.fixture(scope="module")
def undisturbed(tiny_qwen_dir):
    """Per batch kind, undisturbed and without speculation: two choices of one seed
    (``nth_seed``) and a second prompt; plain sampling, then with logits processors (the
    planner's other path)."""
    prompts = random_prompts(512, [5, 9, 5], seed=6)
    prompts[2] = prompts[0]
    processed = replace(P, repetition_penalty=1.3, logit_bias=((7, 2.0),))
    llm = make_llm(tiny_qwen_dir, **VARIANTS["plain"])
    runs = []
    for base in (P, processed):
        params = [base, replace(base, seed=12), base]
        runs.append((prompts, params, run(llm, prompts, params)))
    return runs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_seeded_resume_continues_the_undisturbed_run(tiny_qwen_dir, undisturbed, variant):
    llm = make_llm(tiny_qwen_dir, **VARIANTS[variant])
    for prompts, params, expected in undisturbed:
        assert len({tuple(t) for t in expected}) == len(expected) - 1  # same seed, same prompt: same tokens
        assert run(llm, prompts, params) == expected  # speculation and overlap change no seeded token
        for k in (1, 5, N - 1):
            resumed = run(
                llm, [p + out[:k] for p, out in zip(prompts, expected)], [replace(p, max_tokens=N - k) for p in params]
            )
            assert resumed == [out[k:] for out in expected], f"resumed after {k} tokens"
    if "spec" in variant:
        stats = llm.stats()
        assert 0 < stats["hybridserve_spec_accepted_tokens_total"] < stats["hybridserve_spec_draft_tokens_total"]
