"""What the engine does when a step raises: end the requests it touched, return their
resources, and go on.

A step can fail anywhere: scheduling, planning, preparing inputs, the forward (on the
forward thread), or processing the result. Every batch that was launched and not yet
fully processed is then suspect: its forward may have written part of its slots, and a
batch launched after it ran on that state. So each such batch is abandoned -- its pending
writers cleared without recording any content (nothing it wrote is ever labelled, let
alone published) -- and its requests end with ``abort``, which frees their slots and pages
without publishing. A failure before any batch existed ends every running request (the
scheduler may have been part-way through them). Waiting requests hold nothing and stay.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from workers.cache.checkpoints import StepPlan
from workers.cache.manager import CacheManager
from workers.engine_outputs import EngineOutputs
from workers.forward_thread import StepFuture
from workers.outputs import EngineOutput
from workers.request import FinishReason, Request
from workers.scheduler import Scheduler
from workers.scheduler_types import ScheduledBatch


@dataclass
class LaunchedStep:
    """One batch from its scheduling until its result is fully processed (mutable: the
    fields fill in as the launch gets further)."""

    batch: ScheduledBatch
    plan: StepPlan | None = None
    future: StepFuture | None = None
    completed: bool = False  # the cache has recorded the batch's writes


class FailingEngine(Protocol):
    """What recovery uses of the engine."""

    cache: CacheManager
    scheduler: Scheduler
    outputs: EngineOutputs


class StepFailed(RuntimeError):
    """An engine step raised ``cause``; ``outputs`` are the final outputs (finish reason
    ``abort``) of the requests it ended. The engine itself is usable."""

    def __init__(self, cause: Exception, outputs: list[EngineOutput]) -> None:
        ids = [o.request_id for o in outputs]
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}); ended requests {ids}")
        self.cause = cause
        self.outputs = outputs

    @property
    def request_ids(self) -> list[str]:
        return [o.request_id for o in self.outputs]


def recover_failed_step(engine: FailingEngine, launched: deque[LaunchedStep]) -> list[EngineOutput]:
    """Abandon every launched, unprocessed batch of ``engine`` and end its requests (see the
    module doc); returns their final outputs. Leaves ``launched`` empty."""
    steps = list(launched)
    for step in steps:
        if step.future is not None:
            step.future.exception()  # wait for the forward thread; the error is known
    touched = _touched_requests(engine, steps)
    for step in steps:
        if not step.completed:
            engine.cache.abandon_step(step.batch.batch_id)
    launched.clear()
    outputs = []
    for req in touched:
        if not req.is_finished:
            engine.outputs.finish(req, FinishReason.ABORT)
            outputs.append(engine.outputs.output(req, [], None))
    return outputs


def _touched_requests(engine: FailingEngine, steps: list[LaunchedStep]) -> list[Request]:
    if not steps:
        return list(engine.scheduler.running)
    seen: dict[int, Request] = {}
    for step in steps:
        for seq in step.batch.seqs:
            seen.setdefault(seq.request.handle, seq.request)
    return list(seen.values())
