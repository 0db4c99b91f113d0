"""A step that raises ends its batch's requests, returns their slots and pages, and leaves
the engine usable: the next call's greedy outputs equal a fresh engine's."""

from __future__ import annotations

import pytest

from tests.workers.engine.helpers import assert_no_leaks, greedy_tokens, make_llm, random_prompts
from workers.sampling.params import SamplingParams
from workers.step_failure import StepFailed

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def fail_once(monkeypatch, obj, name: str, at_call: int, exc: BaseException) -> None:
    """Make ``obj.name`` raise ``exc`` on its ``at_call``-th call (1-based), once."""
    original = getattr(obj, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise exc
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapped)


def where(llm, place: str):
    """The object and method a failure is injected into: the scheduler thread's scheduling,
    the launch (inputs prepared after the plan registered its writers), the forward thread."""
    e = llm.engine
    return {"schedule": (e.scheduler, "schedule"), "launch": (e.runner, "launch"), "forward": (e.runner, "_execute")}[
        place
    ]


@pytest.fixture(
    scope="module",
    params=[(True, "none"), (False, "none"), (True, "mtp")],
    ids=["overlap", "no-overlap", "overlap-mtp"],
)
def setup(request, tiny_qwen_dir):
    overlap, spec = request.param
    llm = make_llm(
        tiny_qwen_dir, scheduler={"overlap": overlap}, spec={"method": spec}, debug={"check_invariants": True}
    )
    llm.engine.raise_on_violation = True
    prompts = random_prompts(llm.engine.vocab_size, [9, 17, 5], seed=3)
    reference = greedy_tokens(
        make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False}), prompts, GREEDY
    )
    return llm, prompts, reference


@pytest.mark.parametrize("place,at_call", [("schedule", 4), ("launch", 3), ("forward", 5), ("forward", 1)])
def test_a_failed_step_ends_its_requests_and_the_next_call_works(setup, monkeypatch, place, at_call):
    llm, prompts, reference = setup
    with monkeypatch.context() as m:
        fail_once(m, *where(llm, place), at_call, RuntimeError("kernel exploded"))
        with pytest.raises(StepFailed, match="kernel exploded") as info:
            llm.generate_ids(prompts, [GREEDY] * len(prompts))
    assert info.value.outputs and all(o.finished and o.finish_reason == "abort" for o in info.value.outputs)
    assert_no_leaks(llm)
    assert greedy_tokens(llm, prompts, GREEDY) == reference  # and again, with the cache warm
    assert greedy_tokens(llm, prompts, GREEDY) == reference
    assert_no_leaks(llm)


def test_an_interrupt_cleans_up_and_propagates(setup, monkeypatch):
    llm, prompts, reference = setup
    with monkeypatch.context() as m:
        fail_once(m, llm.engine.scheduler, "on_complete", 3, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            llm.generate_ids(prompts, [GREEDY] * len(prompts))
    assert_no_leaks(llm)
    assert greedy_tokens(llm, prompts, GREEDY) == reference


def test_waiting_requests_survive_a_failed_step(tiny_qwen_dir, monkeypatch):
    """Only the batches' requests end: one still waiting for a slot runs to completion."""
    llm = make_llm(tiny_qwen_dir, scheduler={"max_running_requests": 1})
    e = llm.engine
    prompts = random_prompts(e.vocab_size, [7, 11], seed=4)
    reference = greedy_tokens(llm, prompts[1:], GREEDY)
    e.add_request("first", prompts[0], GREEDY)
    e.add_request("second", prompts[1], GREEDY)
    fail_once(monkeypatch, e.runner, "_execute", 2, RuntimeError("kernel exploded"))
    with pytest.raises(StepFailed) as info:
        while e.has_unfinished():
            e.step()
    assert info.value.request_ids == ["first"]
    tokens: dict[str, list[int]] = {}
    while e.has_unfinished():
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens == {"second": reference[0]}
    assert_no_leaks(llm)
