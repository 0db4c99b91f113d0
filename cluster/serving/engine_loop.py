"""Drive one (not thread-safe) Engine from asyncio: one worker thread, many streams.

Every engine call -- add_request, step, abort, stats, cache events, flush -- runs on ONE
dedicated thread (a single-worker executor), so calls are serialized in submission
order. An asyncio task steps the engine while it has work and hands each output to the
``OutputStream`` of its request; it sleeps on an event when the engine is idle.

Failure: if a step raises, the loop stores the error, fails every open stream with it
and stops; ``error`` is then set and ``check_health`` callers should report it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

from workers.outputs import RequestOutput
from workers.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)


class _StepResult(NamedTuple):
    outputs: list[RequestOutput]
    has_more: bool


class EngineLoopError(RuntimeError):
    """The engine loop died; the replica is unhealthy."""


class OutputStream:
    """Outputs of a group of engine requests (the ``n`` choices of one prompt).

    ``next_batch`` waits for at least one output and returns everything queued, as
    (choice index, output) pairs; it returns None once every request has finished.
    ``close`` aborts whatever has not finished (safe to call from ``finally``, twice).
    """

    def __init__(self, loop: EngineLoop, request_ids: Sequence[str]) -> None:
        self._loop = loop
        self.request_ids = list(request_ids)
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._closed = False

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next_batch(self, not_before: float = 0.0) -> list[tuple[int, RequestOutput]] | None:
        """Wait for an output; if the event loop's clock is before ``not_before`` then, also
        wait until ``not_before`` (coalescing the outputs of several engine steps into one
        batch, so a stream carries fewer, larger items); return everything queued."""
        if not self._unfinished:
            return None
        items = [await self._queue.get()]
        delay = not_before - asyncio.get_running_loop().time()
        if delay > 0 and not _ends(items[0]):
            await asyncio.sleep(delay)
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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop._unregister(self.request_ids)
        if self._unfinished:
            self._loop.abort_soon(sorted(self._unfinished))
            self._unfinished.clear()


class EngineLoop:
    def __init__(self, engine: Any, executor: ThreadPoolExecutor) -> None:
        """``executor`` must be the single-worker executor the engine was built on."""
        self.engine = engine
        self._executor = executor
        self._streams: dict[str, OutputStream] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Future[Any]] = set()
        self.error: BaseException | None = None
        self.num_steps = 0

    @classmethod
    async def create(cls, build: Callable[[], Any]) -> EngineLoop:
        """Build the engine on its own thread (so thread-local torch state matches)."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        engine = await asyncio.get_running_loop().run_in_executor(executor, build)
        loop = cls(engine, executor)
        loop.start()
        return loop

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def run(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the engine thread, after everything queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, self.engine)

    @property
    def num_streams(self) -> int:
        return len({id(s) for s in self._streams.values()})

    async def submit(self, request_ids: Sequence[str], prompt_token_ids: list[int],
                     params: Sequence[SamplingParams]) -> OutputStream:
        """Queue every request or none: a ValueError from the engine undoes the others."""
        if self.error is not None:
            raise EngineLoopError(f"engine loop failed: {self.error!r}")
        stream = OutputStream(self, request_ids)
        for rid in request_ids:
            self._streams[rid] = stream
        try:
            await self.run(lambda e: _add_all(e, request_ids, prompt_token_ids, params))
        except BaseException:
            self._unregister(request_ids)
            raise
        self._wakeup.set()
        return stream

    def abort_soon(self, request_ids: Sequence[str]) -> None:
        """Schedule engine aborts without waiting (usable from ``finally`` blocks)."""
        ids = list(request_ids)
        fut = asyncio.ensure_future(self.run(lambda e: [e.abort(rid) for rid in ids]))
        self._pending.add(fut)
        fut.add_done_callback(self._aborted)

    def _aborted(self, fut: asyncio.Future[Any]) -> None:
        self._pending.discard(fut)
        self._wakeup.set()                # an abort may leave work (e.g. a deferred release)
        if not fut.cancelled() and fut.exception() is not None:
            logger.warning("abort failed: %r", fut.exception())

    def _unregister(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    async def _run(self) -> None:
        try:
            while True:
                self._wakeup.clear()      # before stepping: an add during the step re-sets it
                result = await self.run(_step)
                self.num_steps += 1
                self._dispatch(result.outputs)
                if not result.has_more:
                    await self._wakeup.wait()
                else:
                    await asyncio.sleep(0)  # let consumers drain between steps
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the loop must report, not vanish
            self.error = exc
            for stream in set(self._streams.values()):
                stream._put(exc)
            self._streams.clear()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue                  # closed stream: its abort is on the way
            stream._put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    async def shutdown(self) -> None:
        """Stop stepping; then ``engine.shutdown()`` (if any: a TP engine stops its other
        ranks) on the engine thread, after the step in progress."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        close = getattr(self.engine, "shutdown", None)
        if callable(close):
            try:
                await self.run(lambda engine: close())
            except Exception:  # noqa: BLE001 - shutting down; report, do not raise
                logger.warning("engine shutdown failed", exc_info=True)
        self._executor.shutdown(wait=False, cancel_futures=True)


def _ends(item: RequestOutput | BaseException) -> bool:
    """Whether an item ends its request (or the stream): never hold those back."""
    return isinstance(item, BaseException) or item.finished


def _add_all(engine: Any, request_ids: Sequence[str], prompt: list[int],
             params: Sequence[SamplingParams]) -> None:
    added: list[str] = []
    try:
        for rid, p in zip(request_ids, params):
            engine.add_request(rid, prompt, p)
            added.append(rid)
    except BaseException:
        for rid in added:
            engine.abort(rid)
        raise


def _step(engine: Any) -> _StepResult:
    outputs = engine.step() if engine.has_unfinished() else []
    return _StepResult(outputs, engine.has_unfinished())
