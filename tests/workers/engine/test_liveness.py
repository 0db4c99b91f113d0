"""Liveness and request identity under tight pools (the audit's three hangs and merges).

Each scenario runs the engine step by step with a step bound derived from the work
(``step_bound``): a livelock fails the bound instead of hanging the test run.
"""

from __future__ import annotations

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def step_bound(prompts: list[list[int]], max_tokens: int, page_size: int) -> int:
    """Steps within which every request of a run must finish (see tests/sim/fuzz.py)."""
    return sum(4 * (2 * (len(p) + max_tokens) + (len(p) + max_tokens) // page_size + 2) for p in prompts) + 16


def run_bounded(llm, prompts, params=P) -> list:
    """Submit all, step until done; raises AssertionError past the bound."""
    engine = llm.engine
    ids = [f"live-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        llm.add_request(rid, p, params)
    outs, bound = {}, step_bound(prompts, params.max_tokens, llm.engine.config.cache.page_size)
    for _ in range(bound):
        if not engine.has_unfinished():
            break
        for out in llm.step():
            outs[out.request_id] = out
    assert not engine.has_unfinished(), f"not finished within {bound} steps: {sorted(set(ids) - set(outs))}"
    return [outs[rid] for rid in ids]


def test_preemption_under_overlap_finishes(tiny_qwen_dir):
    """Cache and speculation off, a 6-page KV pool, 5 prompts that each fit alone: under
    overlap the growing request preempted itself because the others were in flight, and
    re-admission put it last, so it was preempted again (about 900 preemptions, 2 of 5 done
    after 3,000 steps). Now about 200 steps, and outputs equal overlap off."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(512, [63, 50, 24, 47, 17], seed=95)
    plain = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    expected = [o.token_ids for o in plain.generate_ids(prompts, [params] * 5)]
    for overlap in (False, True):
        llm = make_llm(
            tiny_qwen_dir,
            cache={"enable_prefix_cache": False, "max_kv_tokens": 96, "page_size": 16},
            scheduler={"overlap": overlap, "chunked_prefill_size": 4},
            debug={"check_invariants": True},
        )
        llm.engine.raise_on_violation = True
        assert [o.token_ids for o in run_bounded(llm, prompts, params)] == expected, overlap
        assert llm.stats()["hybridserve_preemptions_total"] > 0
        counts = llm.engine.pool_counts()
        assert counts["kv_pages_free"] == counts["kv_pages_usable"]


def test_one_slot_follow_up_turn_is_admitted(tiny_qwen_dir):
    """``max_mamba_slots=1``: the follow-up turn matches the only cached checkpoint, which
    admission locked and then could not evict for the request's own live slot (a silent
    hang under overlap, an assertion without). It is admitted without the hit."""
    prompt = random_prompts(512, [13], seed=4)[0]
    plain = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    first = plain.generate_ids([prompt], [P])[0].token_ids
    follow = prompt + first + [7, 8, 9]
    expected = plain.generate_ids([follow], [P])[0].token_ids
    for strategy in ("no_buffer", "extra_buffer_lazy"):
        for overlap in (False, True):
            llm = make_llm(
                tiny_qwen_dir,
                cache={"max_mamba_slots": 1, "mamba_strategy": strategy, "page_size": 1},
                scheduler={"overlap": overlap},
                debug={"check_invariants": True},
            )
            llm.engine.raise_on_violation = True
            assert run_bounded(llm, [prompt])[0].token_ids == first
            assert llm.engine.cache.tree.num_checkpoints == (1 if strategy == "no_buffer" else 0)
            out = run_bounded(llm, [follow])[0]
            assert out.token_ids == expected and out.cached_tokens == 0, (strategy, overlap)


def test_request_id_reused_after_abort(tiny_qwen_dir):
    """An id reused while the aborted request's release waits for its in-flight batch: the
    ledger keyed by the caller's id merged the two and the old release freed the new
    request's slots (I2 violations, then OwnershipError). It is keyed by a handle now."""
    prompts = random_prompts(512, [11, 14], seed=5)
    plain = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    expected = plain.generate_ids([prompts[1]], [P])[0].token_ids
    llm = make_llm(
        tiny_qwen_dir,
        scheduler={"overlap": True},
        spec={"method": "mtp", "num_draft_tokens": 2},
        debug={"check_invariants": True},
    )
    llm.engine.raise_on_violation = True
    engine = llm.engine
    llm.add_request("same", prompts[0], P)
    llm.step()
    llm.step()  # a batch holding "same" is in flight
    assert llm.abort("same") is not None
    llm.add_request("same", prompts[1], P)  # reused before the old release ran
    done = {}
    for _ in range(200):
        for out in llm.step():
            done[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert done["same"].token_ids == expected
    assert engine.check_invariants() == []
    counts = engine.pool_counts()
    assert counts["mamba_slots_free"] + counts["mamba_slots_cached"] == counts["mamba_slots_usable"]
