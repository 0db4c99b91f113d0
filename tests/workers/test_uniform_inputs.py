"""The persistent input batch and the vectorized steady-state inputs equal what the
row-by-row builder makes from scratch."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.workers.engine.helpers import make_llm, random_prompts
from workers.input_batch import InputBatch
from workers.request import Request
from workers.sampling.params import SamplingParams
from workers.step_inputs import PreparedStep, prepare_step
from workers.uniform_inputs import uniform_rows

P = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

# -- the persistent rows under random joins, growths, replacements, preemptions, finishes ------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["join", "grow", "replace", "preempt", "finish", "check"]), st.integers(0, 7), st.integers(1, 5)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_rows_equal_fresh_tables(ops):
    inputs = InputBatch(max_pages=64, num_rows=2)  # small: rows must grow too
    live: dict[int, Request] = {}
    next_page = iter(range(1, 10**6))
    for op, key, n in ops:
        req = live.get(key)
        if op == "join" and req is None:
            live[key] = Request(
                f"r{key}",
                [1],
                P,
                handle=len(live) * 100 + key,
                page_ids=[next(next_page) for _ in range(n)],
                page_epoch=1,
            )
        elif req is None:
            continue
        elif op == "grow":
            req.page_ids.extend(next(next_page) for _ in range(n))
        elif op == "replace":  # a donation swapping the prefix's ids
            req.page_ids[:n] = [next(next_page) for _ in req.page_ids[:n]]
            req.page_epoch += 1
        elif op == "preempt":  # released, then readmitted fresh
            req.page_ids = [next(next_page) for _ in range(n)]
            req.page_epoch += 2
        elif op == "finish":
            inputs.drop(req.handle)
            del live[key]
        reqs = list(live.values())
        if reqs:
            table = inputs.table(inputs.rows(reqs))
            width = max(len(r.page_ids) for r in reqs)
            fresh = [r.page_ids + [0] * (width - len(r.page_ids)) for r in reqs]
            assert table.tolist() == fresh


# -- vectorized vs row-by-row inputs of the steps an engine really launches --------------------
def assert_same(uniform: PreparedStep, general: PreparedStep) -> None:
    if uniform.logits_all_rows:  # no gather: every row's logits are sampled
        assert torch.equal(general.fb.logits_indices, torch.arange(general.fb.num_tokens))
    assert uniform.sample_slots.tolist() == list(general.live_slots)
    for f in fields(PreparedStep):
        a, b = getattr(uniform, f.name), getattr(general, f.name)
        if f.name in ("plan", "sampling", "row_ids", "logits_all_rows", "sample_slots"):
            continue
        if f.name == "fb":
            for g in fields(a):
                if not g.compare:  # derived from the compared fields
                    continue
                x, y = getattr(a, g.name), getattr(b, g.name)
                same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                assert same, (g.name, x, y)
        elif f.name == "writes":
            assert sorted(a, key=repr) == sorted(b, key=repr)
        elif f.name == "page_ids":
            assert [list(p)[: len(q)] for p, q in zip(a, b)] == [list(q) for q in b]
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f.name
        else:
            assert tuple(a) == tuple(b) if f.name == "cu_seqlens" else a == b, (f.name, a, b)


@pytest.mark.parametrize(
    "overrides",
    [
        {"scheduler": {"overlap": True}},
        {"scheduler": {"overlap": False}, "cache": {"mamba_track_interval": 8}},
        {
            "scheduler": {"overlap": True},
            "spec": {"method": "mtp", "num_draft_tokens": 3},
            "cache": {"mamba_track_interval": 8},
        },
    ],
    ids=["decode-overlap", "decode-tracks", "mtp-overlap"],
)
def test_vectorized_inputs_equal_the_row_by_row_builder(tiny_qwen_dir, monkeypatch, overrides):
    llm = make_llm(tiny_qwen_dir, **overrides)
    runner = llm.engine.runner
    prepare = runner._prepare
    compared = []

    def both(plan, sampling=None):
        prepared = prepare(plan, sampling)
        if uniform_rows(plan.batch):
            assert_same(prepared, prepare_step(plan, runner.page_size, runner.device, runner.scratch_base))
            compared.append(plan.batch.batch_id)
        return prepared

    monkeypatch.setattr(runner, "_prepare", both)
    prompts = random_prompts(llm.engine.vocab_size, [5, 11, 23, 8, 17, 3], seed=4)
    reference = make_llm(tiny_qwen_dir, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    expected = [o.token_ids for o in reference.generate_ids(prompts, [P] * len(prompts))]
    for _ in range(2):  # the second pass: prefix hits
        assert [o.token_ids for o in llm.generate_ids(prompts, [P] * len(prompts))] == expected
    assert len(compared) >= 20
