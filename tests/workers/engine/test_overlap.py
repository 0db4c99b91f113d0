"""The overlap scheduler: a real one-step lag, and greedy output identical to lag zero."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def mixed_prompts(vocab: int) -> list[list[int]]:
    prompts = random_prompts(vocab, [3, 9, 14, 22, 31, 40, 6, 17, 27, 12], seed=21)
    shared = random_prompts(vocab, [18], seed=22)[0]
    return prompts + [shared + p[:5] for p in prompts[:6]]


@pytest.fixture(scope="module")
def control(tiny_model_dir):
    """The reference: prefix cache and overlap off."""
    llm = make_llm(tiny_model_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    prompts = mixed_prompts(llm.engine.vocab_size)
    return prompts, [o.token_ids for o in llm.generate_ids(prompts, [P] * len(prompts))]


@pytest.mark.core_families(all_families_for={"strategy": "extra_buffer_lazy"})  # the default
@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_overlap_on_off_identical(tiny_model_dir, control, strategy):
    prompts, expected = control
    for overlap in (False, True):
        llm = make_llm(
            tiny_model_dir,
            scheduler={"overlap": overlap, "chunked_prefill_size": 8},
            cache={"mamba_strategy": strategy, "mamba_track_interval": 8, "max_mamba_slots": 24},
            debug={"check_invariants": True},
        )
        llm.engine.raise_on_violation = True
        for n in range(2):  # the second pass is served from the cache
            outs = llm.generate_ids(prompts, [P] * len(prompts))
            assert [o.token_ids for o in outs] == expected, (overlap, n)
        assert any(o.cached_tokens > 0 for o in outs)
        launches = llm.engine.num_overlapped_launches
        assert launches > 10 if overlap else launches == 0


def test_overlap_stops_exactly_and_frees_everything(tiny_qwen_dir):
    llm = make_llm(tiny_qwen_dir, scheduler={"overlap": True})
    base = llm.generate([7, 8, 9], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop_tok = base.token_ids[6]
    out = llm.generate([7, 8, 9], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok]))[0]
    # The batch already launched for the token after the stop is discarded, not emitted.
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_tok) + 1]
    e = llm.engine
    assert not e.has_unfinished()
    counts = e.pool_counts()
    assert counts["kv_pages_free"] + counts["kv_pages_cached"] == counts["kv_pages_usable"]
    assert counts["mamba_slots_free"] + counts["mamba_slots_cached"] == counts["mamba_slots_usable"]


def test_host_work_waits_until_the_next_forward_has_started(tiny_qwen_dir):
    """Under overlap a step's outputs are processed only once the step launched after it has
    entered its forward (``ModelRunner.wait_started``): the host work then runs beside the
    forward instead of holding the GIL the forward thread needs to get there. The forward
    thread is slowed before each forward, so without the wait the processing would win."""
    import threading
    import time

    llm = make_llm(tiny_qwen_dir, scheduler={"overlap": True})
    engine, runner = llm.engine, llm.engine.runner
    events: list[tuple[str, int]] = []
    fill, mark, process = runner._fill_placeholders, runner._mark_started, engine._process
    step_of = threading.local()

    def slow_fill(prepared):
        time.sleep(0.02)
        step_of.batch = prepared.plan.batch.batch_id
        fill(prepared)

    def marked():
        if runner._starting is not None and not runner._starting.is_set():
            events.append(("started", step_of.batch))
        mark()

    def processed(step):
        out = process(step)
        events.append(("processed", step.batch.batch_id))
        return out

    runner._fill_placeholders, runner._mark_started, engine._process = slow_fill, marked, processed
    prompts = random_prompts(engine.vocab_size, [5, 9, 7], seed=3)
    llm.generate_ids(prompts, [P] * len(prompts))
    order = {e: i for i, e in enumerate(events)}
    launched_after = [b for kind, b in events if kind == "processed" and ("started", b + 1) in order]
    assert len(launched_after) >= 8, events
    assert all(order[("started", b + 1)] < order[("processed", b)] for b in launched_after), events
