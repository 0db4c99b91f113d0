"""Drive one (not thread-safe) Engine from asyncio: one engine thread, many streams.

Every engine call -- add_request, step, abort, stats, cache events, flush -- runs on ONE
dedicated thread, the engine thread. It steps the engine back to back while the engine
has work, and between two steps runs the calls queued by ``run`` (``submit`` and
``abort_soon`` are such calls) in submission order. It never waits for the event loop:
each step's outputs -- token ids, no text -- are handed to the loop with
``call_soon_threadsafe``; there the front-end (``workers.output_processor``) detokenizes
them and matches stop strings, and the deltas fan out to the ``OutputStream`` of their
requests, while the next step already runs. A stop string found there ends the request in
the engine by a queued call (``Engine.stop``). The engine never waits for the event loop
(``LoopTimes.step_gap_s`` measures what it does wait); when it is idle, the thread sleeps
until a call comes.

Failure: a step that fails its own requests (``StepFailed``: the engine ended them and
recovered) fails just their streams, and stepping goes on; ``MAX_FAILED_STEPS`` such
steps in a row, or any other error, is fatal: the loop stores the error, fails every open
stream with it and stops stepping (calls still run: stats, health); ``error`` is then set
and ``check_health`` callers should report it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from workers.output_processor import OutputProcessor
from workers.outputs import EngineOutput, OutputDelta
from workers.sampling.params import SamplingParams
from workers.step_failure import StepFailed

if TYPE_CHECKING:  # the engine's module loads torch; the type is enough here
    from workers.engine import Engine

T = TypeVar("T")
IDLE_POLL_S = 0.001  # the wait after a second step in a row with no output
MAX_FAILED_STEPS = 3  # recovered step failures in a row before the loop gives up
logger = logging.getLogger(__name__)


class _StepResult(NamedTuple):
    outputs: list[EngineOutput]
    has_more: bool
    started: float  # perf_counter when the step began, on the engine thread
    wall_s: float
    cpu_s: float  # that thread's CPU time in it (wall - cpu: waits for a core
    # or the GIL)


class LoopTimes(NamedTuple):
    """Cumulative engine-step times of one ``EngineLoop`` (what the per-hop bench reads)."""

    num_steps: int
    step_wall_s: float
    step_cpu_s: float
    step_gap_s: float  # the engine off its steps between a step and the next while
    # work was left


class EngineLoopError(RuntimeError):
    """The engine loop died; the replica is unhealthy."""


class _Call(NamedTuple):
    fn: Callable[[Engine], Any]
    future: asyncio.Future[Any] | None  # None: nobody waits for the result


class OutputStream:
    """Outputs of a group of engine requests (the ``n`` choices of one prompt).

    ``next_batch`` waits for at least one output and returns everything queued, as
    (choice index, output) pairs; it returns None once every request has finished.
    ``close`` aborts whatever has not finished (safe to call from ``finally``, twice).
    Used from the event loop's thread only (the engine thread reaches it through
    ``EngineLoop._dispatch``, scheduled on the loop).
    """

    def __init__(self, loop: EngineLoop, request_ids: Sequence[str]) -> None:
        self._loop = loop
        self.request_ids = list(request_ids)
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._queue: asyncio.Queue[OutputDelta | BaseException] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._closed = False
        self._wake: asyncio.Future[None] | None = None  # set while next_batch holds a batch back

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: OutputDelta | BaseException) -> None:
        self._queue.put_nowait(item)
        if self._wake is not None and _ends(item) and not self._wake.done():
            self._wake.set_result(None)  # a held batch that now ends a request goes at once

    async def next_batch(self, not_before: float = 0.0) -> list[tuple[int, OutputDelta]] | None:
        """Wait for an output; if the event loop's clock is before ``not_before`` then, also
        wait until ``not_before`` (coalescing the outputs of several engine steps into one
        batch, so a stream carries fewer, larger items) or until an output that ends a
        request arrives, whichever is first; return everything queued."""
        if not self._unfinished:
            return None
        items = [await self._queue.get()]
        delay = not_before - asyncio.get_running_loop().time()
        if delay > 0 and not _ends(items[0]):
            await self._hold(delay)
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        batch = []
        for item in items:
            if isinstance(item, BaseException):
                raise EngineLoopError(f"engine loop failed: {item!r}") from item
            if item.finished:
                self._unfinished.discard(item.request_id)
            batch.append((self._index[item.request_id], item))
        return batch

    async def _hold(self, delay: float) -> None:
        aloop = asyncio.get_running_loop()
        self._wake = aloop.create_future()
        timer = aloop.call_later(delay, _wake_up, self._wake)
        try:
            await self._wake
        finally:
            timer.cancel()
            self._wake = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop._unregister(self.request_ids)
        if self._unfinished:
            self._loop.abort_soon(sorted(self._unfinished))
            self._unfinished.clear()


class EngineLoop:
    """Create with ``await EngineLoop.create(build)``: the engine is built on the engine
    thread (so thread-local torch state is the one it steps with)."""

    def __init__(self, aloop: asyncio.AbstractEventLoop) -> None:
        self.engine: Engine = None  # type: ignore[assignment]  # set by create, before any use
        self.frontend: OutputProcessor | None = None  # the event loop's thread only
        self._aloop = aloop
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._work = threading.Event()  # set by every call; the idle engine thread waits on it
        self._streams: dict[str, OutputStream] = {}
        self._stepping = True  # False: shutting down (calls still run)
        self._closed = False  # the thread has stopped: no more calls
        self.error: BaseException | None = None
        self.num_steps = 0
        self._step_wall_s = self._step_cpu_s = self._step_gap_s = 0.0
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)

    @classmethod
    async def create(cls, build: Callable[[], Engine]) -> EngineLoop:
        loop = cls(asyncio.get_running_loop())
        loop._thread.start()
        try:
            loop.engine = await loop.run(lambda _: build())
        except BaseException:
            loop._closed = True
            loop._work.set()
            raise
        loop.frontend = OutputProcessor(loop.engine.tokenizer)
        loop._work.set()  # the engine exists now: start stepping if it has work
        return loop

    async def run(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread, after everything queued before it (and
        between two steps). Cancelling the caller skips ``fn`` unless it already started."""
        if self._closed:
            raise EngineLoopError("engine loop is shut down")
        future: asyncio.Future[T] = self._aloop.create_future()
        self._calls.put(_Call(fn, future))
        self._work.set()
        return await future

    @property
    def times(self) -> LoopTimes:
        return LoopTimes(self.num_steps, self._step_wall_s, self._step_cpu_s, self._step_gap_s)

    @property
    def num_streams(self) -> int:
        return len({id(s) for s in self._streams.values()})

    async def submit(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        outputs: Sequence[Sequence[int]] = (),
        handoff: bool = False,
    ) -> OutputStream:
        """Queue every request (one prompt each) or none: a ValueError from the engine undoes the others.

        ``outputs``: per request, output tokens generated elsewhere (``Engine.add_request``'s
        ``output_prefix``). ``handoff``: run each request to its first token only (a PD
        prefill); a choice that would go on finishes with ``handoff``."""
        if self.error is not None:
            raise EngineLoopError(f"engine loop failed: {self.error!r}")
        stream = OutputStream(self, request_ids)
        assert self.frontend is not None
        prefixes = list(outputs) or [()] * len(request_ids)
        try:
            for rid, prompt, p, prefix in zip(request_ids, prompts, params, prefixes):
                self._streams[rid] = stream
                self.frontend.add(rid, prompt, p, prefix, handoff)
        except ValueError:
            self._unregister(request_ids)
            raise
        engine_params = [first_token_only(p) for p in params] if handoff else list(params)
        try:
            await self.run(lambda e: _add_all(e, request_ids, prompts, engine_params, prefixes))
        except BaseException as exc:
            self._unregister(request_ids)
            if isinstance(exc, asyncio.CancelledError):
                self.abort_soon(request_ids)  # the add may have run before the cancel
            raise
        return stream

    def abort_soon(self, request_ids: Sequence[str]) -> None:
        """Queue engine aborts without waiting (usable from ``finally`` blocks)."""
        ids = list(request_ids)
        if not self._closed:
            self._calls.put(_Call(lambda e: _abort_all(e, ids), None))
            self._work.set()

    def _unregister(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)
            if self.frontend is not None:
                self.frontend.discard(rid)

    # -- the engine thread ---------------------------------------------------------------
    def _main(self) -> None:
        last_end: float | None = None  # the previous step's end, when it left work
        empty = 0  # steps in a row without outputs (an overlap launch gives one)
        failed = 0  # recovered step failures in a row
        while not self._closed:
            self._run_calls()
            if not (self._stepping and self.error is None and self.engine is not None and self._has_work()):
                last_end = None
                self._work.wait()
                self._work.clear()  # then re-check: a call set before the clear is queued
                continue
            try:
                result = _step(self.engine)
            except StepFailed as exc:
                failed += 1
                logger.error("engine step failed (%d in a row): %s", failed, exc, exc_info=exc.cause)
                self._post(self._fail_requests, exc)
                if failed >= MAX_FAILED_STEPS:
                    self.error = exc
                    self._post(self._fail_streams, exc)
                continue
            except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
                self.error = exc
                self._post(self._fail_streams, exc)
                continue
            failed = 0
            self.num_steps += 1
            self._step_wall_s += result.wall_s
            self._step_cpu_s += result.cpu_s
            if last_end is not None:
                self._step_gap_s += result.started - last_end
            last_end = result.started + result.wall_s if result.has_more else None
            empty = 0 if result.outputs else empty + 1
            if result.outputs:
                self._post(self._dispatch, result.outputs)
            elif empty > 1:  # work only in other threads (a grammar compiling): do not spin
                self._work.wait(IDLE_POLL_S)
                self._work.clear()  # a call that set it is queued: the loop's top runs it

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop's thread (dropped once that loop is closed)."""
        try:
            self._aloop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            self._closed = True

    def _has_work(self) -> bool:
        try:
            return bool(self.engine.has_unfinished())
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
            self._post(self._fail_streams, exc)
            return False

    def _run_calls(self) -> None:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            if call.future is not None and call.future.cancelled():
                continue  # its caller is gone (read racily: at worst it runs)
            try:
                value, error = call.fn(self.engine), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                value, error = None, exc
            if call.future is not None:
                self._post(_resolve, call.future, value, error)
            elif error is not None:
                logger.warning("engine call failed: %r", error)

    # -- the event loop's thread ---------------------------------------------------------
    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        assert self.frontend is not None
        processed = self.frontend.process(outputs)  # closed streams' requests are discarded there
        if processed.stop:
            ids = processed.stop
            self._calls.put(_Call(lambda e: _stop_all(e, ids), None))
            self._work.set()
        for delta in processed.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # closed stream: its abort is on the way
            stream._put(delta)
            if delta.finished:
                self._streams.pop(delta.request_id, None)
                self.frontend.discard(delta.request_id)

    def _fail_requests(self, exc: StepFailed) -> None:
        """The streams of the requests a failed step ended get its error."""
        for rid in exc.request_ids:
            if self.frontend is not None:
                self.frontend.discard(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(exc)

    def _fail_streams(self, exc: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream._put(exc)
        self._streams.clear()

    async def shutdown(self) -> None:
        """Stop stepping; then ``engine.shutdown()`` (if any: a TP engine stops its other
        ranks) on the engine thread, after the step in progress; then the thread ends."""
        if self._closed:
            return
        self._stepping = False
        close = getattr(self.engine, "shutdown", None)
        if callable(close):
            try:
                await self.run(lambda engine: close())
            except Exception:  # noqa: BLE001 - shutting down; report, do not raise
                logger.warning("engine shutdown failed", exc_info=True)
        else:
            await self.run(lambda engine: None)  # wait for the step in progress
        self._closed = True
        self._work.set()


def _resolve(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _wake_up(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _ends(item: OutputDelta | BaseException) -> bool:
    """Whether an item ends its request (or the stream): never hold those back."""
    return isinstance(item, BaseException) or item.finished


def first_token_only(params: SamplingParams) -> SamplingParams:
    """``params`` for a PD prefill: its first token drawn exactly as in a whole run (EOS and
    stop tokens blocked when ``min_tokens`` > 0), then a finish by length."""
    if params.max_tokens <= 1:
        return params
    return replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def _add_all(
    engine: Engine,
    request_ids: Sequence[str],
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    prefixes: Sequence[Sequence[int]],
) -> None:
    added: list[str] = []
    try:
        for rid, prompt, p, prefix in zip(request_ids, prompts, params, prefixes):
            engine.add_request(rid, prompt, p, prefix)
            added.append(rid)
    except BaseException:
        for rid in added:
            engine.abort(rid)
        raise


def _abort_all(engine: Engine, request_ids: Sequence[str]) -> None:
    for rid in request_ids:
        engine.abort(rid)


def _stop_all(engine: Engine, request_ids: Sequence[str]) -> None:
    for rid in request_ids:
        engine.stop(rid)


def _step(engine: Engine) -> _StepResult:
    start, cpu = time.perf_counter(), time.thread_time()
    outputs = engine.step() if engine.has_unfinished() else []
    return _StepResult(outputs, engine.has_unfinished(), start, time.perf_counter() - start, time.thread_time() - cpu)
