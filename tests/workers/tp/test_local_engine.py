"""TP = 2 without Ray: ``LLM(parallel={"tensor_parallel_size": 2})`` spawns rank 1 as a process.

Every registered family: greedy output at its ``tp_world`` equals TP = 1 through the whole
engine, with prefix caching (the second pass hits it), the overlap scheduler and, where the
family has MTP weights, speculation; ``check_invariants`` makes the ranks compare a digest of
their decisions (tokens, acceptance, drafts) after every step.

Qwen3-Next then mixes greedy rows with seeded and unseeded sampling rows (sampling must agree
across ranks too) and rank 1 is killed: the health check and the next step fail at once
instead of hanging. A rank that is stopped instead (alive, holding its sockets) fails the next
step within the group's bound and shutdown kills it; when rank 0 fails mid-step, rank 1 exits
at once.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams
from workers.sampling.structured import StructuredOutput

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
UNSEEDED = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, ignore_eos=True)
SPEC = {"method": "mtp", "num_draft_tokens": 2}
# Processors and a grammar: registers and matchers live on every rank and must agree.
PENALISED = SamplingParams(
    max_tokens=16,
    temperature=0.0,
    ignore_eos=True,
    repetition_penalty=1.3,
    frequency_penalty=0.5,
    logit_bias={17: 4.0},
    bad_words=("ab",),
)
CONSTRAINED = SamplingParams(
    max_tokens=16, temperature=0.0, structured_output=StructuredOutput.regex(r"[a-z]{3}-[0-9]{2,4}")
)
# Sampled rows are not compared with TP = 1 (the all-reduce changes the last bits of the
# logits) but the ranks' digests must agree, so every rank's matcher must see the same.
CONSTRAINED_SAMPLED = SamplingParams(
    max_tokens=16, temperature=0.8, seed=5, structured_output=StructuredOutput.regex(r"[a-z]{3}-[0-9]{2,4}")
)
PROCESSED = [PENALISED, CONSTRAINED, CONSTRAINED_SAMPLED] * 2


def prompts_with_shared_prefix() -> list[list[int]]:
    prompts = random_prompts(512, [5, 17, 9, 30, 12], seed=2)
    return prompts + [prompts[3][:20] + [7, 8, 9]]


def reference(path, params: list[SamplingParams] | None = None) -> list[list[int]]:
    """Every variant off: TP = 1, no prefix cache, no speculation, no overlap."""
    llm = make_llm(path, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    prompts = prompts_with_shared_prefix()
    return [o.token_ids for o in llm.generate_ids(prompts, params or [GREEDY] * len(prompts))]


def engine_options(has_mtp: bool) -> dict:
    options: dict = {"debug": {"check_invariants": True}}
    if has_mtp:
        options["spec"] = SPEC
    return options


@pytest.mark.core_families
def test_tp_equals_tp1(tiny_model):
    family, path = tiny_model.family, tiny_model.path
    prompts = prompts_with_shared_prefix()
    options = engine_options(family.has_mtp)
    expected = reference(path)
    llm = make_llm(path, parallel={"tensor_parallel_size": family.tp_world}, **options)
    llm.engine.raise_on_violation = True
    try:
        for _ in range(2):  # the second pass hits the cache
            got = [o.token_ids for o in llm.generate_ids(prompts, [GREEDY] * len(prompts))]
            assert got == expected
        stats = llm.stats()
        assert stats["hybridserve_prefix_hit_tokens_total"] > 0
        assert llm.engine.runner.num_steps > 0
        if family.has_mtp:
            assert stats["hybridserve_spec_draft_tokens_total"] > 0
    finally:
        llm.shutdown()


def test_tp2_sampling_agrees_and_a_dead_rank_fails_fast(tiny_qwen_dir):
    prompts = prompts_with_shared_prefix()
    options = engine_options(True)
    expected = reference(tiny_qwen_dir)
    expected_processed = reference(tiny_qwen_dir, PROCESSED)
    llm = make_llm(tiny_qwen_dir, parallel={"tensor_parallel_size": 2}, **options)
    llm.engine.raise_on_violation = True
    try:
        mixed = [GREEDY, SEEDED, UNSEEDED] * 2
        outs = llm.generate_ids(prompts, mixed)
        assert [outs[i].token_ids for i in (0, 3)] == [expected[0], expected[3]]
        got = [o.token_ids for o in llm.generate_ids(prompts, PROCESSED)]
        assert [got[i] for i in (0, 1, 3, 4)] == [expected_processed[i] for i in (0, 1, 3, 4)]

        rank1 = llm.engine.workers.procs[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            llm.engine.check_workers()
        with pytest.raises(RuntimeError, match=r"(?i)connection|peer|closed"):
            llm.generate_ids(prompts[:1], [GREEDY])
    finally:
        llm.shutdown()


BOUND_S = 1.5  # rank 0's peer bound in the failure tests (set after the start)
SLACK_S = 15.0  # process and scheduling delays on a loaded machine
ONE_REQUEST = (random_prompts(512, [6], seed=4)[:1], [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)])


def small_tp2(tiny_checkpoint):
    """A TP = 2 engine of a cheap family, and its rank 1's process."""
    llm = make_llm(tiny_checkpoint("mamba2"), parallel={"tensor_parallel_size": 2})
    return llm, llm.engine.workers.procs[0]


@pytest.mark.timeout(300)
def test_tp2_a_stalled_rank_fails_the_next_step_within_the_bound(tiny_checkpoint):
    """SIGSTOP: rank 1 cannot post its receive, and a gloo send waits for it, so rank 0's
    next send is bounded by the group's timeout alone -- behind it wait the forward thread,
    ``shutdown`` and pytest's exit. A stopped process also outlives SIGTERM: shutdown must
    kill it, or multiprocessing's exit handler waits for it forever."""
    llm, rank1 = small_tp2(tiny_checkpoint)
    try:
        assert len(llm.generate_ids(*ONE_REQUEST)[0].token_ids) == 3  # the group works
        llm.engine.tp.timeout = timedelta(seconds=BOUND_S)
        os.kill(rank1.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"(?i)timed out"):
            llm.generate_ids(*ONE_REQUEST)
        assert time.monotonic() - start < BOUND_S + SLACK_S
        with pytest.raises(RuntimeError, match=r"closed: step \d+ failed on rank 0"):
            llm.generate_ids(*ONE_REQUEST)  # at once
        with pytest.raises(RuntimeError, match=r"group closed: step \d+ failed on rank 0"):
            llm.engine.check_workers()  # the replica's health check fails
        llm.shutdown()  # no Stop to send: kill rank 1
        assert time.monotonic() - start < BOUND_S + 2 * SLACK_S
        assert not rank1.is_alive()
    finally:
        if rank1.is_alive():
            os.kill(rank1.pid, signal.SIGKILL)
        llm.shutdown()


@pytest.mark.timeout(300)
def test_tp2_rank_0_failing_mid_step_ends_rank_1_at_once(tiny_checkpoint, monkeypatch):
    """Rank 0 fails after sending a step (rank 1 then waits in the step's first all-reduce):
    rank 0 closes the group, so rank 1 fails and exits now rather than at its bound (300 s),
    and shutdown does not wait on it."""
    llm, rank1 = small_tp2(tiny_checkpoint)
    try:
        assert len(llm.generate_ids(*ONE_REQUEST)[0].token_ids) == 3

        def broken(*args, **kwargs):
            raise RuntimeError("rank 0 broke before its forward")

        monkeypatch.setattr(llm.engine.runner, "_execute", broken)
        with pytest.raises(RuntimeError, match="rank 0 broke before its forward"):
            llm.generate_ids(*ONE_REQUEST)
        rank1.join(SLACK_S)
        assert rank1.exitcode == 1
        start = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start < SLACK_S
    finally:
        if rank1.is_alive():
            os.kill(rank1.pid, signal.SIGKILL)
        llm.shutdown()
