"""``scheduler.policy: lpm`` on a real engine: the waiting queue's order changes, the
tokens of every request do not (against ``fcfs`` and a cache-off control), with the
host tier on and off, overlap on, invariants checked after every step."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def policy_llm(model_dir, policy, host):
    cache = {"mamba_strategy": "extra_buffer_lazy", "page_size": 4, "mamba_track_interval": 8, "max_mamba_slots": 10}
    if host:
        cache.update(host_mamba_slots=32, host_kv_tokens=2048)
    llm = make_llm(
        model_dir,
        cache=cache,
        scheduler={"max_running_requests": 2, "policy": policy},
        debug={"check_invariants": True},
    )
    llm.engine.raise_on_violation = True
    return llm


def run_in_order(llm, prompts):
    """Submit ``prompts`` as q0, q1, ... at once; returns (tokens by id, ids in admission order)."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        llm.add_request(f"q{i}", p, P)
    tokens: dict[str, list[int]] = {}
    admitted: list[str] = []
    while engine.has_unfinished():
        for out in llm.step():
            tokens[out.request_id] = list(out.token_ids)
        admitted += [r.request_id for r in engine.scheduler.running if r.request_id not in admitted]
    return tokens, admitted


@pytest.mark.parametrize("host", [False, True])
def test_lpm_changes_the_order_not_the_tokens(tiny_qwen_dir, host):
    vocab = make_llm(tiny_qwen_dir).engine.vocab_size
    turn1 = random_prompts(vocab, [20, 23, 26, 29], seed=31)
    cold = random_prompts(vocab, [18, 21, 24], seed=32)
    runs, hits = {}, {}
    for policy in ("fcfs", "lpm"):
        llm = policy_llm(tiny_qwen_dir, policy, host)
        outs1 = llm.generate_ids(turn1, [P] * len(turn1))
        turn2 = [p + o.token_ids + q for p, o, q in zip(turn1, outs1, random_prompts(vocab, [5] * 4, seed=33))]
        if host:  # every checkpoint demoted: the queue sees host depths only
            tree = llm.engine.cache.tree
            tree.evict_checkpoints(tree.num_evictable_checkpoints)
            assert all(tree.peek(p[:-1]).depth == 0 for p in turn2)
        runs[policy] = run_in_order(llm, cold + turn2)  # the cold prompts arrive first
        hits[policy] = llm.stats()["hybridserve_prefix_hit_tokens_total"]
    off = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    expected = {f"q{i}": o.token_ids for i, o in enumerate(off.generate_ids(cold + turn2, [P] * 7))}
    assert runs["fcfs"][0] == runs["lpm"][0] == expected
    assert runs["fcfs"][1] == [f"q{i}" for i in range(7)]
    assert runs["lpm"][1][:2] != ["q0", "q1"]  # cached second turns admitted first
    assert set(runs["lpm"][1][:2]) <= {"q3", "q4", "q5", "q6"}
    # lpm resumes all four second turns (>= 20 tokens each) before the cold prompts' own
    # checkpoints can evict theirs (10 slots); fcfs admits the cold ones first.
    assert hits["lpm"] >= 4 * 20 and hits["lpm"] >= hits["fcfs"]
