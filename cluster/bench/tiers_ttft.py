"""TTFT split into queue wait and prefill, in steps and in modelled time (``bench/tiers.py``).

Per request: ``queue`` = arrival -> admitted, ``prefill`` = admitted -> first token. In
global steps of the in-process cluster: admitted = the step it joins its replica's running
requests, first token = the step whose output carries it (one step after its batch, under
the overlap lag). In **modelled** seconds, on a clock per replica that each launched batch
advances by its ``StepCost`` (forwards back to back): arrival = the replica's clock then
(the end of its batch in flight), admitted = the start of the first batch holding the
request, first token = the end of the batch that samples it. The modelled cost is

    cost = a + b * computed prompt tokens + c * decode rows

(a deterministic model of the engine's own step time, calibrated once from this engine's
``forward_seconds`` on the tiny Qwen3-Next, ``fit_step_cost``; ``--calibrate`` refits it on
the machine at hand). A step counts as one step whatever its number of prompt tokens, so a
prefix hit shows in modelled time but hardly in steps; wall-clock seconds need an idle
machine, modelled seconds do not. Arrivals and think times stay in global steps (the
replicas advance in lockstep): the modelled figures weigh each step a request waits by what
its replica computed in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.scheduler_types import ScheduledBatch


@dataclass(frozen=True)
class StepCost:
    """Seconds of one forward: ``a`` per step, ``b`` per computed prompt token, ``c`` per
    decode row. The default is ``fit_step_cost`` over the steps of one device-only and one
    tiers-on ``slot_pressure`` run (32 x 4, 4 replicas; 2,487 steps) on the shared 2-core
    CPU machine the project is built on (load average ~3.8): fixed here, so that modelled
    figures are counts."""

    a: float = 0.0101
    b: float = 0.00014
    c: float = 0.00245

    def __call__(self, computed: int, rows: int) -> float:
        return self.a + self.b * computed + self.c * rows


def batch_shape(batch: ScheduledBatch) -> tuple[int, int]:
    """(computed prompt tokens, decode rows) of a batch: a row is a decode when it feeds one
    token past the prompt and samples; everything else (prefill chunks, a preempted
    request's recompute) is computed tokens."""
    computed = rows = 0
    for seq in batch.seqs:
        if seq.num_new_tokens == 1 and seq.samples and seq.start >= seq.request.num_prompt_tokens:
            rows += 1
        else:
            computed += seq.num_new_tokens
    return computed, rows


def fit_step_cost(samples: Sequence[tuple[int, int, float]]) -> StepCost:
    """Least squares of ``seconds ~ a + b * computed + c * rows`` over (computed, rows,
    seconds) samples; raises ValueError with fewer than 3 distinct shapes."""
    import numpy as np

    if len({(c, r) for c, r, _ in samples}) < 3:
        raise ValueError(f"fit_step_cost needs 3 or more distinct step shapes, got {len(samples)} samples")
    x = np.array([[1.0, c, r] for c, r, _ in samples])
    y = np.array([s for _, _, s in samples])
    (a, b, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    return StepCost(float(a), float(b), float(c))


@dataclass
class RequestTimes:
    """One request's stamps: global steps and its replica's modelled clock."""

    arrival_step: int
    arrival_clock: float
    admit_step: int | None = None
    admit_clock: float | None = None
    first_step: int | None = None
    first_clock: float | None = None


class StepLog:
    """Watches one engine: its modelled clock, first admissions, and (``calibrate``) the
    measured seconds of each processed batch beside its shape. Reads the scheduler's
    batches through a wrapper of ``Scheduler.on_launch``; changes nothing it watches."""

    def __init__(self, engine: Any, cost: StepCost, calibrate: bool = False) -> None:
        self.engine, self.cost = engine, cost
        self.clock = 0.0
        self.times: dict[str, RequestTimes] = {}
        self.samples: list[tuple[int, int, float]] = []
        self._shapes: dict[int, tuple[int, int]] = {}
        self._sampled: dict[str, float] = {}  # request id -> end of the batch sampling its first token
        launch = engine.scheduler.on_launch

        def on_launch(batch: ScheduledBatch) -> None:
            shape = batch_shape(batch)
            start, self.clock = self.clock, self.clock + cost(*shape)
            self._stamp(batch, start)
            if calibrate:
                self._shapes[batch.batch_id] = shape
            launch(batch)

        engine.scheduler.on_launch = on_launch
        if calibrate:
            process = engine._process

            def on_process(step: Any) -> Any:
                seconds = step.future.result().forward_seconds
                self.samples.append((*self._shapes.pop(step.batch.batch_id), seconds))
                return process(step)

            engine._process = on_process

    def _stamp(self, batch: ScheduledBatch, start: float) -> None:
        for seq in batch.seqs:
            t = self.times.get(seq.request.request_id)
            if t is None:
                continue
            if t.admit_clock is None:
                t.admit_clock = start
            if seq.samples and seq.request.request_id not in self._sampled:
                self._sampled[seq.request.request_id] = self.clock

    def on_arrival(self, rid: str, step: int) -> None:
        self.times[rid] = RequestTimes(step, self.clock)

    def after_step(self, step: int) -> None:
        """Stamp the first admission of every request now running (a promoting request
        counts as admitted: it holds its slot and waits for its copy, not for the queue)."""
        for req in self.engine.scheduler.running:
            t = self.times.get(req.request_id)
            if t is not None and t.admit_step is None:
                t.admit_step = step

    def on_first_token(self, rid: str, step: int) -> None:
        t = self.times[rid]
        if t.first_step is None:
            t.first_step, t.first_clock = step, self._sampled.pop(rid, self.clock)
            if t.admit_step is None:  # admitted and sampled within one step (no overlap)
                t.admit_step = step
            if t.admit_clock is None:
                t.admit_clock = t.first_clock


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def ttft_split(logs: Iterable[StepLog]) -> dict[str, float]:
    """Means over requests with a first token: TTFT, queue wait and prefill, in steps and in
    modelled seconds (``ttft = queue + prefill`` in both units); the longest TTFT in steps
    (what a queue-reordering policy could starve)."""
    done = [t for log in logs for t in log.times.values() if t.first_step is not None]
    out: dict[str, float] = {
        "requests": len(done),
        "max_ttft_steps": max((t.first_step - t.arrival_step for t in done), default=0),
    }
    for unit, arrival, admit, first in (
        ("steps", "arrival_step", "admit_step", "first_step"),
        ("model_s", "arrival_clock", "admit_clock", "first_clock"),
    ):
        out[f"ttft_{unit}"] = round(_mean([getattr(t, first) - getattr(t, arrival) for t in done]), 4)
        out[f"queue_{unit}"] = round(_mean([getattr(t, admit) - getattr(t, arrival) for t in done]), 4)
        out[f"prefill_{unit}"] = round(_mean([getattr(t, first) - getattr(t, admit) for t in done]), 4)
    return out


def format_split(rows: Sequence[tuple[str, bool, dict[str, float]]], cost: StepCost) -> str:
    """(router, tiers, ``ttft_split``) rows: mean TTFT = queue + prefill, steps and modelled s."""
    lines = [
        f"mean TTFT = queue wait + prefill, in global steps and modelled seconds "
        f"(a={cost.a:.4g} s + b={cost.b:.3g} s/token + c={cost.c:.3g} s/decode row; tiers_ttft.py):",
        f"{'router':<15}{'tiers':>6}{'ttft st':>9}{'queue st':>9}{'prefill st':>11}"
        f"{'ttft ms':>9}{'queue ms':>9}{'prefill ms':>11}{'max st':>8}",
    ]
    for router, tiers, sp in rows:
        lines.append(
            f"{router:<15}{'on' if tiers else 'off':>6}{sp['ttft_steps']:>9.2f}"
            f"{sp['queue_steps']:>9.2f}{sp['prefill_steps']:>11.2f}{1e3 * sp['ttft_model_s']:>9.1f}"
            f"{1e3 * sp['queue_model_s']:>9.1f}{1e3 * sp['prefill_model_s']:>11.1f}"
            f"{sp['max_ttft_steps']:>8}"
        )
    return "\n".join(lines)
