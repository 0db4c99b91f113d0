"""A compiled CPU call (inductor's C++ wrapper) runs without the GIL only if dropping its
inputs does not take it back: ``CallOptions`` holds each tensor argument by one more C++
reference for the call (``kernels/native_refs.cpp``). Checked twice: the references the
called function sees (exact), and the calling thread's waits for the GIL while another
thread runs Python (every GIL acquisition then waits, a voluntary context switch; a matter
of scheduling, so the most of several calls is compared)."""

from __future__ import annotations

import os
import resource
import sys
import threading
from dataclasses import dataclass

import pytest
import torch

from kernels import native_ops
from workers.compiled.cache import CallOptions, compile_for_owner, graph_inputs, new_owner

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not native_ops.load(),
    reason="per-thread context switches (Linux) and the native ops",
)


@dataclass(frozen=True)
class Batch:  # a ForwardBatch in small: tensor fields and a host field
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    d: torch.Tensor
    e: torch.Tensor
    size: int


NUM_INPUTS = 5  # Batch's tensors


class Chain(torch.nn.Module):
    def step(self, batch: Batch, owner: int) -> torch.Tensor:
        out = batch.a * 2
        for x in (batch.b, batch.c, batch.d, batch.e):  # each input's last use comes early (the
            out = torch.tanh(out @ x)  # graph drops it there), ms apart
        return out


def _fresh(size: int = 512) -> Batch:
    gen = torch.Generator().manual_seed(0)
    return Batch(*(torch.randn(size, size, generator=gen) / size**0.5 for _ in range(NUM_INPUTS)), size=size)


def _switches_during(fn) -> int:
    """Voluntary context switches of this thread while ``fn`` runs with another thread
    spinning in Python (so that every GIL acquisition here waits)."""
    stop = threading.Event()
    spinning = threading.Event()

    def spin() -> None:
        spinning.set()
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    spinning.wait()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    fn()
    after = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    stop.set()
    thread.join()
    return after - before


@pytest.fixture(scope="module")
def compiled():
    chain = Chain()
    fn = compile_for_owner(chain.step, new_owner(), fullgraph=True)
    opts = CallOptions(cpp_wrapper=True)
    assert opts.hold_inputs
    with torch.inference_mode():
        batch = _fresh()
        assert torch.allclose(opts.call(fn, batch, 1), chain.step(batch, 1), atol=1e-5)
    opts.warm = True
    return fn, opts, chain


def test_graph_inputs_are_the_tensors_and_dataclass_tensor_fields():
    batch, plain = _fresh(), torch.zeros(2)
    got = graph_inputs((batch, plain, 3, (plain,)))
    assert [id(t) for t in got] == [id(batch.a), id(batch.b), id(batch.c), id(batch.d), id(batch.e), id(plain)]


def test_a_call_holds_each_tensor_argument_once_more(compiled):
    opts = CallOptions(cpp_wrapper=True)
    batch, plain = _fresh(2), torch.zeros(1)
    seen: list[int] = []

    def fn(b: Batch, x: torch.Tensor, owner: int) -> None:
        seen.extend(t._use_count() for t in graph_inputs((b, x)))

    opts.call(fn, batch, plain, 1)
    assert seen == [2] * (NUM_INPUTS + 1)  # the Python object's reference and the call's
    assert [t._use_count() for t in graph_inputs((batch, plain))] == [1] * (NUM_INPUTS + 1)
    opts.hold_inputs = False
    seen.clear()
    opts.call(fn, batch, plain, 1)
    assert seen == [1] * (NUM_INPUTS + 1)


@pytest.mark.skipif(
    os.getloadavg()[0] > 1.5,
    reason="needs a quiet machine: under load the spinning thread "
    "is often off its core when the graph drops an input, so the unheld waits do not show",
)
def test_held_inputs_leave_the_graph_without_the_gil(compiled):
    fn, opts, chain = compiled

    def run(hold: bool) -> int:
        opts.hold_inputs = hold
        with torch.inference_mode():
            batch = _fresh()
            return _switches_during(lambda: opts.call(fn, batch, 1))

    try:
        held = [run(True) for _ in range(5)]
        unheld = [run(False) for _ in range(5)]
    finally:
        opts.hold_inputs = True
    # unheld, each tensor argument the graph drops costs a wait for the GIL (the most of
    # several calls: a call can miss the spinning thread's turns, and then waits for nothing)
    assert max(unheld) - max(held) >= NUM_INPUTS - 1, (held, unheld)


def test_held_and_unheld_calls_agree(compiled):
    fn, opts, chain = compiled
    with torch.inference_mode():
        batch = _fresh()
        held = opts.call(fn, batch, 1)
        opts.hold_inputs = False
        try:
            unheld = opts.call(fn, batch, 1)
        finally:
            opts.hold_inputs = True
        assert torch.equal(held, unheld)
        assert torch.allclose(held, chain.step(batch, 1), atol=1e-5)
