"""The forward thread's light futures and signals behave as the engine relies on."""

from __future__ import annotations

import threading
import time

import pytest

from workers.forward_thread import ForwardThread, Signal, StepFuture


def test_calls_run_in_order_on_one_thread_and_results_come_back():
    worker = ForwardThread("test-forward")
    seen: list[tuple[int, str]] = []

    def call(i: int):
        def run() -> int:
            time.sleep(0.001 * (3 - i % 3))
            seen.append((i, threading.current_thread().name))
            return i * i

        return run

    futures = [worker.submit(call(i)) for i in range(12)]
    assert [f.result() for f in futures] == [i * i for i in range(12)]
    assert [i for i, _ in seen] == list(range(12)) and {n for _, n in seen} == {"test-forward"}
    worker.shutdown()


def test_an_error_is_kept_for_its_reader_and_the_thread_goes_on():
    worker = ForwardThread("test-forward")
    bad = worker.submit(lambda: 1 / 0)
    good = worker.submit(lambda: 7)
    assert isinstance(bad.exception(), ZeroDivisionError)
    with pytest.raises(ZeroDivisionError):
        bad.result()
    assert good.result() == 7 and good.exception() is None and good.done()
    worker.shutdown()


def test_a_signal_releases_every_waiter_and_may_be_set_twice():
    signal, woke = Signal(), []
    waiters = [threading.Thread(target=lambda: (signal.wait(), woke.append(1))) for _ in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.02)
    assert not woke and not signal.is_set()
    signal.set()
    signal.set()
    for w in waiters:
        w.join(5)
    assert woke == [1, 1, 1]
    signal.wait()  # set: returns at once


def test_a_future_is_done_only_once_set():
    future: StepFuture[int] = StepFuture()
    assert not future.done()
    threading.Timer(0.02, future.set_result, (5,)).start()
    assert future.result() == 5 and future.done()
