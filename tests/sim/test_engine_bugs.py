"""Engine bugs the simulation found, kept as regression tests (each fixed; each also
reproduced on the real tiny model, so none is an artefact of the toy runner).
"""

from __future__ import annotations

import torch

from tests.sim.harness import Sim
from tests.workers.engine.helpers import make_llm
from workers.cache.checkpoints import StepPlan
from workers.request import Request
from workers.sampling.params import SamplingParams
from workers.scheduler_types import ScheduledBatch, ScheduledSeq
from workers.spec.drafter import MtpDrafter
from workers.step_inputs import prepare_step

G = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


# -- 1. verify scratch rows overlap when verifies of one batch differ in width ---------------
# step_inputs._add_seq places verify i's per-row snapshots at scratch_base + i * n, with n
# the width of verify i itself. A verify cut short (by the max_batch_tokens budget or by
# max_model_len in Scheduler._num_drafts) then shares scratch slots with the verify before
# it: that verify commits another sequence's state into its live slot (and track slot).


def test_verify_scratch_slots_are_disjoint():
    p = SamplingParams(max_tokens=8, temperature=0.0)
    seqs = []
    for i, width in enumerate((3, 2)):
        req = Request(f"r{i}", [5, 6, 7, 8, 9], p)
        req.page_ids, req.mamba_slot = list(range(1 + 10 * i, 8 + 10 * i)), 1 + i
        seqs.append(ScheduledSeq(req, 4, width, samples=True, num_draft_tokens=width - 1))
    prepared = prepare_step(
        StepPlan(ScheduledBatch(0, tuple(seqs), ()), (), ()), 1, torch.device("cpu"), scratch_base=20
    )
    a, b = (set(v.scratch) for v in prepared.verify)
    assert not a & b, (sorted(a), sorted(b))


def test_budget_cut_verify_keeps_outputs(tiny_qwen_dir):
    # No prefix cache, no overlap: two requests, the second's verify cut to 1 draft by the
    # 5-token budget; drafts always right, so the first verify commits scratch[2].
    overrides = {
        "cache": {"enable_prefix_cache": False},
        "scheduler": {"overlap": False, "max_running_requests": 2, "max_batch_tokens": 5, "chunked_prefill_size": 5},
        "spec": {"method": "mtp", "num_draft_tokens": 2},
    }
    with Sim(tiny_qwen_dir, overrides, script=lambda rid, pos, first, k: k) as sim:
        prompts = [[10, 11, 12], [20, 21, 22]]
        out = [o.token_ids for o in sim.run(prompts, G)]
        assert sim.runner.corruptions == []
        assert out == [sim.vocab.greedy(p, G.max_tokens) for p in prompts]


def test_budget_cut_verify_real_model(tiny_qwen_dir, monkeypatch):
    prompts = [[10, 11, 12], [20, 21, 22]]
    plain = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    expected = [o.token_ids for o in plain.generate_ids(prompts, [G, G])]
    full = {tuple(p): p + e for p, e in zip(prompts, expected)}
    llm = make_llm(
        tiny_qwen_dir,
        cache={"enable_prefix_cache": False},
        scheduler={"overlap": False, "max_running_requests": 2, "max_batch_tokens": 5, "chunked_prefill_size": 5},
        spec={"method": "mtp", "num_draft_tokens": 2},
    )
    original = MtpDrafter._chain

    def oracle_chain(self, spans, hidden, last_pos):  # drafts = the true continuation
        original(self, spans, hidden, last_pos)
        for span, t in zip(spans, last_pos):
            f = full[tuple(llm.engine.requests[span.request_id].prompt_token_ids)]
            self.draft_tokens[span.live_slot] = torch.tensor(
                [f[t + 2 + j] if t + 2 + j < len(f) else 0 for j in range(self.k)]
            )

    monkeypatch.setattr(MtpDrafter, "_chain", oracle_chain)
    assert [o.token_ids for o in llm.generate_ids(prompts, [G, G])] == expected


# -- 2. preemption picks a request already scheduled in the same step ------------------------
# Scheduler._grow_pages picks the youngest running request with no batch in flight. Under
# overlap with speculation, the requests after the one growing can all be in flight (a
# prefill chunk in flight is scheduled again), so the search walks back to an older request
# that this very schedule() already gave a seq: it is preempted (pages released) while its
# seq stays in the batch, and prepare_step indexes its empty page list (IndexError).

PREEMPT_CASE = dict(
    overrides={
        "cache": {"enable_prefix_cache": False, "page_size": 1, "max_kv_tokens": 24},
        "scheduler": {"overlap": True, "max_running_requests": 2, "chunked_prefill_size": 4, "max_batch_tokens": 64},
        "spec": {"method": "mtp", "num_draft_tokens": 2},
    },
    prompts=[list(range(10, 13)), list(range(100, 120))],
    params=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
)


def test_preemption_spares_scheduled_requests(tiny_qwen_dir):
    c = PREEMPT_CASE
    with Sim(tiny_qwen_dir, c["overrides"]) as sim:
        out = [o.token_ids for o in sim.run(c["prompts"], c["params"])]
        limit = sim.engine.max_model_len
        assert out == [sim.vocab.greedy(p, c["params"].max_tokens)[: limit - len(p)] for p in c["prompts"]]


def test_preemption_spares_scheduled_requests_real_model(tiny_qwen_dir):
    c = PREEMPT_CASE
    plain = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    expected = [o.token_ids for o in plain.generate_ids(c["prompts"], [c["params"]] * 2)]
    llm = make_llm(tiny_qwen_dir, **c["overrides"])
    limit = llm.engine.max_model_len
    got = [o.token_ids for o in llm.generate_ids(c["prompts"], [c["params"]] * 2)]
    assert got == [e[: limit - len(p)] for p, e in zip(c["prompts"], expected)]
    assert llm.stats()["hybridserve_preemptions_total"] > 0


# -- 3. no_buffer publishes a live slot that a discarded verify already advanced ------------
# A request finishes (stop token) while its next verify is in flight; its release waits for
# that batch (the live slot has a writer), then no_buffer's finish publishes the live slot
# at num_computed_tokens. A verify advances num_computed_tokens only when processed (after
# the deferred release ran), so the label is the pre-verify depth while the slot holds the
# post-verify state: the node at the prompt's depth holds H(depth + 1 + accepted).

NO_BUFFER_CASE = {
    "cache": {"mamba_strategy": "no_buffer", "page_size": 1},
    "scheduler": {"overlap": True},
    "spec": {"method": "mtp", "num_draft_tokens": 2},
}


def test_no_buffer_finish_with_verify_in_flight(tiny_qwen_dir):
    with Sim(tiny_qwen_dir, NO_BUFFER_CASE) as sim:
        p = list(range(10, 18))
        stop = sim.vocab.greedy(p, 1)[0]
        sim.run([p], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)))
        q = p + [77]
        out = sim.run([q], G)[0]
        assert list(sim.oracles.aliased.values()) == []
        assert out.token_ids == sim.vocab.greedy(q, G.max_tokens)


def test_no_buffer_finish_with_verify_in_flight_real_model(tiny_qwen_dir):
    p = list(range(10, 18))
    q = p + [77]
    plain = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False})
    stop = plain.generate_ids([p], [G])[0].token_ids[0]
    expected = plain.generate_ids([q], [G])[0].token_ids
    llm = make_llm(tiny_qwen_dir, **NO_BUFFER_CASE)
    llm.generate_ids([p], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))])
    assert llm.generate_ids([q], [G])[0].token_ids == expected
