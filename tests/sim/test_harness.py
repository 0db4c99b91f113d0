"""The harness itself: the toy runner reproduces the analytic greedy continuation in every
engine mode, scripted acceptance is exact, and the oracles catch planted corruption."""

from __future__ import annotations

import pytest

from tests.sim.harness import Sim, distinct_prompts
from tests.sim.toy import EMPTY, ToyState, ToyVocab, chain, fold
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_hash_chain_names_prefix_and_depth():
    a, b = chain([5, 6, 7]), chain([5, 6, 8])
    assert a.depth == b.depth == 3 and a.digest != b.digest
    assert fold(chain([5, 6]), 7) == a and chain([], EMPTY) == EMPTY
    v = ToyVocab(512)
    assert all(v.low <= v.emit(ToyState(d, 0)) < v.high for d in range(0, 1 << 20, 4099))
    assert all(v.wrong(t) != t and v.low <= v.wrong(t) < v.high for t in range(v.low, v.high))


MODES = {
    "plain": {"cache": {"enable_prefix_cache": False}, "scheduler": {"overlap": False}},
    "overlap": {"cache": {"enable_prefix_cache": False}},
    "spec": {
        "cache": {"enable_prefix_cache": False},
        "scheduler": {"overlap": False},
        "spec": {"method": "mtp", "num_draft_tokens": 3},
    },
    "spec_overlap_lazy": {
        "cache": {"page_size": 4, "mamba_track_interval": 8},
        "spec": {"method": "mtp", "num_draft_tokens": 3},
    },
    "spec_overlap_extra_buffer": {
        "cache": {"mamba_strategy": "extra_buffer", "page_size": 2, "mamba_track_interval": 4},
        "spec": {"method": "mtp", "num_draft_tokens": 2},
    },
    "overlap_no_buffer": {"cache": {"mamba_strategy": "no_buffer", "page_size": 1}},
}


@pytest.mark.parametrize("mode", MODES)
def test_toy_engine_matches_analytic_greedy(tiny_qwen_dir, mode):
    with Sim(
        tiny_qwen_dir, {**MODES[mode], "scheduler": {"chunked_prefill_size": 8, **MODES[mode].get("scheduler", {})}}
    ) as sim:
        prompts = distinct_prompts(10, 9, sim.vocab, seed=4)
        prompts += [p[:6] + q[:5] for p, q in zip(prompts, prompts[1:])]  # shared prefixes
        expected = [sim.vocab.greedy(p, P.max_tokens) for p in prompts]
        for _ in range(2):  # second: prefix hits
            assert [o.token_ids for o in sim.run(prompts, P)] == expected
        s = sim.summary()
        assert s["aliased"] == 0 and s["violations"] == {} and s["corruptions"] == 0
        assert s["keep_label_mismatches"] == 0 and s["live_mismatches"] == 0
        assert (s["overlapped_launches"] > 0) == (sim.engine.lag == 1)


@pytest.mark.parametrize("accept", [0, 1, 3])
def test_scripted_acceptance_is_exact(tiny_qwen_dir, accept):
    overrides = {"cache": {"enable_prefix_cache": False}, "spec": {"method": "mtp", "num_draft_tokens": 3}}
    with Sim(tiny_qwen_dir, overrides, script=lambda rid, pos, first, k: accept) as sim:
        prompts = distinct_prompts(4, 5, sim.vocab, seed=5)
        assert [o.token_ids for o in sim.run(prompts, P)] == [sim.vocab.greedy(p, P.max_tokens) for p in prompts]
        stats = sim.stats()
        drafted = stats["hybridserve_spec_draft_tokens_total"]
        accepted = stats["hybridserve_spec_accepted_tokens_total"]
        assert drafted > 0 and accepted * 3 == drafted * accept


def test_oracles_catch_a_planted_corruption(tiny_qwen_dir):
    overrides = {"cache": {"page_size": 1, "mamba_track_interval": 8}, "spec": {"method": "mtp", "num_draft_tokens": 2}}
    with Sim(tiny_qwen_dir, overrides) as sim:
        p = distinct_prompts(1, 7, sim.vocab, seed=6)[0]
        sim.run([p], P)
        tree = sim.engine.cache.tree
        node = tree.peek(p[:6]).node
        assert node.depth == 6 and sim.oracles.aliased == {}
        sim.runner.pool[node.checkpoint.slot] = fold(sim.runner.pool[node.checkpoint.slot], 3)  # H(7) at 6
        sim.check()
        assert [(a.node_depth, a.held_depth) for a in sim.oracles.aliased.values()] == [(6, 7)]
        out = sim.run([p], P)[0]  # matches the planted node
        assert out.cached_tokens == 6
        assert out.token_ids != sim.vocab.greedy(p, P.max_tokens)
        assert [(c.start, c.got_depth) for c in sim.runner.corruptions][:1] == [(6, 7)]
