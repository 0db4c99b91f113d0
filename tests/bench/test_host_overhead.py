"""``hybridserve bench host-overhead``: the probe's accounting (a fake clock, exact), its
table against today's engine, the JSON the CLI prints, and the engine's per-request host
work counted in calls (not timed) at two batch sizes."""

from __future__ import annotations

import itertools
import json
import sys
import threading
import types
from pathlib import Path

import pytest

from cluster.bench import host_overhead as H
from cluster.bench import host_overhead_probe as P
from cluster.cli import main


@pytest.fixture(scope="module")
def null_model(tmp_path_factory) -> Path:
    return H.build_model(tmp_path_factory.mktemp("host-overhead") / "null")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Work:
    """outer burns 3 s, calls inner (5 s), burns 2 s more; lone burns 7 s."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def outer(self) -> str:
        self.clock.now += 3
        self.inner()
        self.clock.now += 2
        return "done"

    def inner(self) -> None:
        self.clock.now += 5

    def lone(self) -> None:
        self.clock.now += 7


def test_phases_are_exclusive_and_missing_paths_make_a_phase_absent(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(P, "time", types.SimpleNamespace(thread_time=clock))
    work = Work(clock)
    probe = P.Probe(
        work,
        phases={"outer": ("outer",), "gone": ("no.such", "nope"), "half": ("inner", "missing")},
        forward_paths=("lone",),
    )
    with probe.installed():
        assert work.outer() == "done"
        work.lone()
        totals = probe.totals()
        assert totals.seconds == {"outer": 5.0, "half": 5.0, P.FORWARD: 7.0} and totals.calls == 3
        assert probe.absent == ["gone"] and probe.missing == {"gone": ["no.such", "nope"], "half": ["missing"]}
        probe.reset()
        assert probe.totals().seconds == {} and probe.totals().calls == 0
    assert "outer" not in vars(work) and "lone" not in vars(work)  # the class's methods again


def test_module_paths_are_wrapped_and_restored():
    import workers.model_runner as runner

    original = runner.prepare_step
    probe = P.Probe(object(), phases={"inputs": ("workers.model_runner:prepare_step",)}, forward_paths=())
    with probe.installed():
        assert runner.prepare_step is not original and "inputs" not in probe.absent
    assert runner.prepare_step is original
    assert P.resolve(object(), "workers.no_such_module:f") is None


def test_the_table_matches_the_engine(null_model):
    """Every path of PHASES and the model's forward resolve on today's engine (a rename in the
    engine shows here: update host_overhead_probe.PHASES)."""
    engine = H.build_engine(null_model, "mtp", H.Settings(batches=(2,), steps=1, warmup=0))
    try:
        probe = P.Probe(engine)
        with probe.installed():
            pass
        missing = {k: v for k, v in probe.missing.items() if k != P.FORWARD}
        assert missing == {}, f"host_overhead_probe.PHASES is out of date: {missing}"
        assert {"model.forward", "model.compute_logits", "drafter.mtp.forward"}.isdisjoint(
            probe.missing.get(P.FORWARD, [])
        )
    finally:
        engine.runner.shutdown()


def test_cli_prints_the_result_as_its_last_json_line(null_model, capsys):
    rc = main(
        [
            "bench",
            "host-overhead",
            "--model",
            str(null_model),
            "--batch",
            "1",
            "4",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--min-request-steps",
            "1",
            "--json",
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["host_us_per_request_step"]) == {"1", "4"}
    points = {(p["mode"], p["batch"]): p for p in result["points"]}
    for mode in ("default", "mtp"):
        for batch in ("1", "4"):
            host = result[mode]["host_us_per_request_step"][batch]
            phases = result[mode]["phases_us_per_request_step"][batch]
            assert host > 0 and result[mode]["host_us_per_step"][batch] > 0
            assert set(phases) == set(P.PHASES) | {"other"} and min(phases.values()) >= 0
            # The phases are measured CPU; host subtracts the wrappers' estimated cost from it.
            probe = points[mode, int(batch)]["probe_us_per_step"] / int(batch)
            assert sum(v for k, v in phases.items() if k != "other") <= (host + probe) * 1.001 + 0.01
            assert result[mode]["tokens_per_request_step"][batch] > 0
    assert result["host_us_per_request_step"] == result["default"]["host_us_per_request_step"]
    assert result["absent_phases"] == {"default": [], "mtp": []}
    assert all(v == 0 for v in result["default"]["verified_per_request_step"].values())
    assert all(v > 0 for v in result["mtp"]["verified_per_request_step"].values())
    assert points["default", 4]["forward_us_per_step"] > 0 and points["default", 4]["eager_steps"] == 3


class CallCounter:
    """Python and builtin calls (profile events) of the main thread and of every thread
    started after it is built (the engine's forward thread starts at its first launch)."""

    def __init__(self) -> None:
        self._calls, self._on = itertools.count(), False
        threading.setprofile(self._profile)

    def _profile(self, frame, event, arg) -> None:
        if self._on and event in ("call", "c_call"):
            next(self._calls)  # atomic under the GIL: two threads count here

    def count(self, fn) -> int:
        start = next(self._calls)
        sys.setprofile(self._profile)
        self._on = True
        try:
            fn()
        finally:
            self._on = False
            sys.setprofile(None)
        return next(self._calls) - start - 1

    def close(self) -> None:
        threading.setprofile(None)


def calls_per_request_step(
    engine, counter: CallCounter, mode: str, batch: int, settings: H.Settings, steps: int = 4
) -> float:
    """Calls per request and step in a steady decode window of ``steps`` steps."""
    ids = H.add_requests(engine, batch, settings, 3 if mode == "mtp" else 0)
    H.until_decoding(engine, ids, settings.admit_steps)
    for _ in range(2):
        engine.step()
    total = counter.count(lambda: [engine.step() for _ in range(steps)])
    H.drain(engine, ids)
    return total / (steps * batch)


@pytest.mark.parametrize("mode", ["default", "mtp"])
def test_host_calls_per_request_do_not_grow_with_the_batch(null_model, mode):
    """Quadratic host bookkeeping (a membership test in a list of requests with a field-by-
    field ``__eq__``, a set rebuilt per request, a sum over the verifies before each one)
    shows as calls per request-step growing with B. Counted, not timed: 64 vs 256."""
    settings = H.Settings(batches=(64, 256), steps=4, warmup=2)
    engine = H.build_engine(null_model, mode, settings)
    counter = CallCounter()  # before the first step starts the forward thread
    try:
        small, large = (calls_per_request_step(engine, counter, mode, b, settings) for b in (64, 256))
    finally:
        counter.close()
        engine.runner.shutdown()
    assert large / small <= 1.2, f"{mode}: {small:.0f} calls per request-step at 64, {large:.0f} at 256"
