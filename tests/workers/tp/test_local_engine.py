"""TP = 2 without Ray: ``LLM(parallel={"tensor_parallel_size": 2})`` spawns rank 1 as a process.

Qwen3-Next with prefix caching, the overlap scheduler and MTP speculation; the batch mixes
greedy rows with seeded and unseeded sampling rows. Greedy rows must equal TP = 1;
``check_invariants`` makes the ranks compare a digest of their decisions (tokens,
acceptance, drafts) after every step, so sampling must agree across ranks too. Then rank
1 is killed: the health check and the next step fail at once instead of hanging.
"""
from __future__ import annotations

import os
import signal

import pytest

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
UNSEEDED = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, ignore_eos=True)
ENGINE = {"spec": {"method": "mtp", "num_draft_tokens": 2}, "debug": {"check_invariants": True}}


def test_tp2_equals_tp1_and_a_dead_rank_fails_fast(tiny_qwen_dir):
    prompts = random_prompts(512, [5, 17, 9, 30, 12], seed=2)
    prompts.append(prompts[3][:20] + [7, 8, 9])
    # The reference has every variant off: TP = 1, no prefix cache, no speculation, no overlap.
    ref = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    expected = [o.token_ids for o in ref.generate_ids(prompts, [GREEDY] * len(prompts))]

    llm = make_llm(tiny_qwen_dir, parallel={"tensor_parallel_size": 2}, **ENGINE)
    llm.engine.raise_on_violation = True
    try:
        for _ in range(2):                                   # the second pass hits the cache
            got = [o.token_ids for o in llm.generate_ids(prompts, [GREEDY] * len(prompts))]
            assert got == expected
        mixed = [GREEDY, SEEDED, UNSEEDED] * 2
        outs = llm.generate_ids(prompts, mixed)
        assert [outs[i].token_ids for i in (0, 3)] == [expected[0], expected[3]]
        stats = llm.stats()
        assert stats["hybridserve_prefix_hit_tokens_total"] > 0
        assert stats["hybridserve_spec_draft_tokens_total"] > 0
        assert llm.engine.runner.num_steps > 0

        rank1 = llm.engine.workers.procs[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            llm.engine.check_workers()
        with pytest.raises(RuntimeError, match=r"(?i)connection|peer|closed"):
            llm.generate_ids(prompts[:1], [GREEDY])
    finally:
        llm.shutdown()
