"""The forward thread: one worker running submitted calls in submission order, with light
futures and signals.

``concurrent.futures``' Future and ``threading.Event`` are condition variables written in
Python (a waiter list, a new lock per wait); every step hands off through them twice, which
shows at small batches. Here completion is one lock, taken at creation and released once
when the result is in (a waiter takes and returns it), and the queue is the C
``queue.SimpleQueue``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Signal:
    """A one-shot event: ``set`` (any number of times) releases every ``wait``."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:  # set only on one thread (the forward thread)
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self) -> None:
        if not self._set:
            self._lock.acquire()
            self._lock.release()


class StepFuture(Generic[T]):
    """The result of one submitted call (``result``, ``exception``, ``done`` as
    ``concurrent.futures.Future``'s, without timeouts or callbacks)."""

    __slots__ = ("_signal", "_value", "_error")

    def __init__(self) -> None:
        self._signal = Signal()
        self._value: Any = None
        self._error: BaseException | None = None

    def set_result(self, value: T) -> None:
        self._value = value
        self._signal.set()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._signal.set()

    def done(self) -> bool:
        return self._signal.is_set()

    def exception(self) -> BaseException | None:
        self._signal.wait()
        return self._error

    def result(self) -> T:
        self._signal.wait()
        if self._error is not None:
            raise self._error
        return self._value

    @classmethod
    def of(cls, fn: Callable[[], T]) -> StepFuture[T]:
        """``fn()`` run now, on this thread."""
        future: StepFuture[T] = cls()
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
            future.set_exception(exc)
        return future


class ForwardThread:
    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], StepFuture[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> StepFuture[T]:
        future: StepFuture[T] = StepFuture()
        self._queue.put((fn, future))
        return future

    def shutdown(self) -> None:
        """Run what was submitted, then end the thread."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the future
                future.set_exception(exc)
