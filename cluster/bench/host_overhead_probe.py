"""Thread CPU time of an engine's step, split by phase, through wrappers named in one table.

``PHASES`` maps a phase to the callables whose CPU time is that phase's; ``FORWARD`` lists
the model's own computations (target forward and logits, compiled steps, the MTP head),
which the host figure leaves out. A path is an attribute path from the engine
(``"scheduler.schedule"``) or ``"module:attr"`` for a module global that the engine looks up
at call time (``"workers.model_runner:prepare_step"``). The engine's authors keep the table
in step with the code: a path that does not resolve makes its phase absent (reported, not
raised), and its time falls into ``other``.

Each wrapped call is timed with ``time.thread_time`` on whichever thread runs it, exclusively:
a wrapped call inside another one (a drafter forward calling the target's logits, a phase
inside ``_process``) counts only for itself, so the phases and the forward never overlap and
sum to at most the process's CPU time. A wrapper costs two clock reads (~0.5 us each here):
``Probe.overhead_s`` estimates what the wrappers themselves cost, to subtract. Only calls
made once per batch are wrapped; a per-request wrapper would cost more than the work it
measures.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# Phase -> the callables whose exclusive CPU time is the phase's (see the module docstring).
PHASES: dict[str, tuple[str, ...]] = {
    "schedule": ("scheduler.schedule",),
    "plan": ("cache.plan_step",),
    "inputs": ("workers.model_runner:prepare_step", "workers.model_runner:prepare_uniform", "runner.planner.build"),
    "sampling": ("runner.sampler.decide",),
    # What _process does besides "complete": the engine's outputs (token-id deltas, stop
    # tokens and lengths, per-token stats). Text and stop strings are the front-end's
    # (workers.output_processor, on the consumer's thread): not in Engine.step.
    "output": ("_process",),
    "complete": ("cache.complete_step", "scheduler.on_complete", "cache.donate_unfinished"),
}
FORWARD = "forward"
# The model's computations: left out of the host figure.
FORWARD_PATHS: tuple[str, ...] = (
    "model.forward",
    "model.compute_logits",
    "model.logits_from",
    "runner.compiled.run",
    "drafter.mtp.forward",
    "drafter.compiled_chain.run",
    "drafter.compiled_chain.run_verified",
)


@dataclass(frozen=True)
class Hook:
    phase: str
    path: str
    owner: Any  # the object (or module) holding the attribute
    name: str
    had_own: bool  # the owner's __dict__ held the attribute before (restored on exit)
    original: Any


@dataclass(frozen=True)
class ProbeTotals:
    """CPU seconds per phase (``FORWARD`` among them) and wrapped calls, since a reset."""

    seconds: dict[str, float]
    calls: int


class _Frame:
    __slots__ = ("phase", "start", "child")

    def __init__(self, phase: str, start: float) -> None:
        self.phase, self.start, self.child = phase, start, 0.0


def resolve(root: Any, path: str) -> tuple[Any, str] | None:
    """(owner, attribute name) of ``path`` from ``root`` (or a ``module:attr`` path); None
    where any part is missing or the target is not callable."""
    try:
        if ":" in path:
            module, _, rest = path.partition(":")
            owner: Any = importlib.import_module(module)
        else:
            owner, rest = root, path
        *parents, name = rest.split(".")
        for part in parents:
            owner = getattr(owner, part)
        target = getattr(owner, name)
    except (AttributeError, ImportError):
        return None
    return (owner, name) if owner is not None and callable(target) else None


class Probe:
    """Installs the timing wrappers on one engine (``installed``); reads and resets totals.

    Per-thread accumulators (a thread appends its own under a lock once), so two threads
    never update one number; ``totals`` sums them."""

    def __init__(
        self,
        engine: Any,
        phases: dict[str, tuple[str, ...]] | None = None,
        forward_paths: tuple[str, ...] = FORWARD_PATHS,
    ) -> None:
        self.engine = engine
        self.table = {**(PHASES if phases is None else phases), FORWARD: forward_paths}
        self.missing: dict[str, list[str]] = {}  # phase -> paths that did not resolve
        self._hooks: list[Hook] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._threads: list[tuple[dict[str, float], list[int]]] = []

    @property
    def absent(self) -> list[str]:
        """Phases none of whose paths resolved."""
        return [p for p, paths in self.table.items() if len(self.missing.get(p, [])) == len(paths)]

    @contextmanager
    def installed(self) -> Iterator[Probe]:
        self._install()
        try:
            yield self
        finally:
            for hook in reversed(self._hooks):
                if hook.had_own:
                    setattr(hook.owner, hook.name, hook.original)
                else:
                    delattr(hook.owner, hook.name)
            self._hooks.clear()

    def _install(self) -> None:
        for phase, paths in self.table.items():
            for path in paths:
                found = resolve(self.engine, path)
                if found is None:
                    self.missing.setdefault(phase, []).append(path)
                    continue
                owner, name = found
                original = getattr(owner, name)
                had_own = name in getattr(owner, "__dict__", {})
                self._hooks.append(Hook(phase, path, owner, name, had_own, original))
                setattr(owner, name, self._wrap(phase, original))

    def _wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            seconds, stack, calls = self._mine()
            frame = _Frame(phase, clock())
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - frame.start
                stack.pop()
                seconds[phase] = seconds.get(phase, 0.0) + elapsed - frame.child
                calls[0] += 1
                if stack:
                    stack[-1].child += elapsed

        return timed

    def _mine(self) -> tuple[dict[str, float], list[_Frame], list[int]]:
        local = self._local
        if not hasattr(local, "seconds"):
            local.seconds, local.stack, local.calls = {}, [], [0]
            with self._lock:
                self._threads.append((local.seconds, local.calls))
        return local.seconds, local.stack, local.calls

    def totals(self) -> ProbeTotals:
        with self._lock:
            threads = list(self._threads)
        seconds: dict[str, float] = {}
        for per_thread, _ in threads:
            for phase, s in list(per_thread.items()):
                seconds[phase] = seconds.get(phase, 0.0) + s
        return ProbeTotals(seconds, sum(c[0] for _, c in threads))

    def reset(self) -> None:
        """Zero the totals (call between steps: no wrapped call may be running)."""
        with self._lock:
            for per_thread, calls in self._threads:
                per_thread.clear()
                calls[0] = 0


def wrapper_cost_s(calls: int = 20000) -> float:
    """CPU seconds one wrapped call adds around its target (two clock reads, the frame, the
    accounting), measured on an empty function."""
    probe = Probe(None, phases={}, forward_paths=())
    timed = probe._wrap("calibration", lambda: None)

    def plain() -> None:
        return None

    start = time.thread_time()
    for _ in range(calls):
        plain()
    base = time.thread_time() - start
    start = time.thread_time()
    for _ in range(calls):
        timed()
    return max(0.0, (time.thread_time() - start - base) / calls)
