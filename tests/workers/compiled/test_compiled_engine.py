"""Compiled steps (``compile.enabled``) against the eager engine, on both original tiny
families: greedy output identical with overlap on (and speculation on Qwen3-Next, whose
tiny checkpoint has an MTP head: compiled verify steps and draft chains), at every bucket
size, at a batch size between two buckets and above the largest (eager); after start-up
nothing compiles again; the steps write the pools with the C++ op, never calling back into
Python; the switch off builds no compiled step.

The reference runs every variant off (compile, speculation, overlap, prefix cache). One
compiled engine per family is shared by the module (compilation is slow on two cores)."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from kernels import native_ops
from kernels.static import _scatter_rows
from tests.workers.engine.helpers import make_llm, random_prompts
from workers.compiled import Bucket
from workers.sampling.params import SamplingParams

BUCKETS = (1, 3)
BATCHES = (1, 2, 3, 4)  # 2: between the buckets; 4: above them (eager)
P = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SPEC = {"qwen3_next": {"method": "mtp", "num_draft_tokens": 2}, "granitemoehybrid": {"method": "none"}}


@pytest.fixture(scope="module", params=sorted(SPEC))
def family(request, tiny_checkpoint):
    return request.param, tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def reference(family):
    name, path = family
    llm = make_llm(path, compile={"enabled": False}, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    prompts = random_prompts(llm.engine.vocab_size, [5, 11, 8, 14], seed=16)
    return llm, prompts, {n: [o.token_ids for o in llm.generate_ids(prompts[:n], [P] * n)] for n in BATCHES}


@pytest.fixture(scope="module")
def compiled(family, compile_cache_dir):
    name, path = family
    return make_llm(
        path,
        spec=SPEC[name],
        scheduler={"overlap": True},
        compile={"enabled": True, "batch_sizes": BUCKETS, "cache_dir": str(compile_cache_dir)},
    )


def test_compiled_greedy_equals_eager(family, reference, compiled):
    _, prompts, expected = reference
    graphs = counters["stats"]["unique_graphs"]
    steps = compiled.engine.runner.compiled
    calls_before = dict(steps.num_calls)
    paths = compiled.engine.stats.labelled["hybridserve_engine_steps_total"]
    counted_before = dict(paths)
    for n in BATCHES:
        assert [o.token_ids for o in compiled.generate_ids(prompts[:n], [P] * n)] == expected[n], n
    assert counters["stats"]["unique_graphs"] == graphs  # every graph compiled at start-up
    ran = {b: steps.num_calls[b] - calls_before[b] for b in steps.buckets}
    drafter = compiled.engine.drafter
    rows = 1 if drafter is None else drafter.k + 1
    assert all(ran[Bucket(size, rows)] > 0 for size in BUCKETS), ran
    # the steps metric by path counts what ran: every compiled call, and eager prefills
    assert paths["compiled"] - counted_before.get("compiled", 0) == sum(ran.values())
    assert paths["eager"] - counted_before.get("eager", 0) >= len(BATCHES)
    if drafter is not None:
        assert drafter.compiled_chain is not None
        chain = drafter.compiled_chain
        assert all(chain.num_calls[size] > 0 and chain.num_verify_calls[size] > 0 for size in BUCKETS)


def test_the_switch_off_builds_no_compiled_step(reference):
    llm = reference[0]
    assert llm.config.compile.enabled is False
    assert llm.engine.runner.compiled is None


def test_compiled_steps_write_the_pools_without_python(family, reference, compiled):
    """A compiled CPU step calls no Python op (``kernels/native_ops.py``): the Python pool
    write, counted here through its CPU kernel, is never entered while compiled decode,
    verify and draft-chain steps run (eager prefills write with plain indexing)."""
    assert native_ops.loaded(), native_ops.failure()
    _, prompts, expected = reference
    steps = compiled.engine.runner.compiled
    before = sum(steps.num_calls.values())
    entered: list[int] = []

    def counting(dst, index, src):
        entered.append(int(index.numel()))
        dst.index_copy_(0, index, src)

    _scatter_rows.register_kernel("cpu")(counting)
    try:
        got = [o.token_ids for o in compiled.generate_ids(prompts[:3], [P] * 3)]
    finally:
        _scatter_rows.register_kernel("cpu")(lambda dst, index, src: dst.index_copy_(0, index, src))
    assert got == expected[3]
    assert sum(steps.num_calls.values()) > before
    assert entered == []
