"""Seeded draws keyed by position: a row's token depends on (seed, position) only."""

from __future__ import annotations

from collections import Counter

import torch

from tests.workers.sampling.helpers import Harness, decode, request, step_inputs
from workers.sampling.params import SEED_RANGE, SamplingParams
from workers.sampling.seeded import position_seed

P = SamplingParams(temperature=1.0, seed=3)


def test_position_seeds_are_distinct_and_valid_generator_seeds():
    seeds = [SEED_RANGE[0], -1, 0, 1, 2, SEED_RANGE[1]]
    keys = {position_seed(s, pos) for s in seeds for pos in range(500)}
    assert len(keys) == len(seeds) * 500
    assert len({k & 0xFFFFFFFF for k in keys}) == len(keys)  # a CPU generator keeps 32 bits
    for key in list(keys)[:5]:
        torch.Generator().manual_seed(key)


def tokens_at(outputs_before: int, companions: int, seed_of_harness: int, vocab: int = 8) -> int:
    """The seeded request's token after ``outputs_before`` outputs, beside unseeded rows."""
    h = Harness(vocab, seed=seed_of_harness)
    reqs = [request("s", [1, 2, 3], [4] * outputs_before, P)]
    reqs += [request(f"o{i}", [5, 6], [], SamplingParams(temperature=1.0)) for i in range(companions)]
    seqs = [decode(r) for r in reqs]
    si = h.build(seqs)
    logits = torch.zeros(len(seqs), vocab)
    gens = [h.bank.get(r.handle, r.params.seed) for r in reqs]
    decision = h.sampler.decide(
        si, step_inputs(seqs, [[]] * len(seqs)), logits, [r.params for r in reqs], gens, [None] * len(seqs), None
    )
    return decision.token_ids[0][0]


def test_a_seeded_token_depends_on_its_position_only():
    for at in (0, 3, 9):
        picks = {tokens_at(at, companions, seed_of_harness) for companions in (0, 1, 5) for seed_of_harness in (0, 9)}
        assert len(picks) == 1
    counts = Counter(tokens_at(at, 0, 0) for at in range(400))  # uniform over 8 tokens
    assert len(counts) == 8 and max(counts.values()) < 90
