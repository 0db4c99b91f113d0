"""Stage (c) of the device checks, its plan within the stage's budget (one GPU, <= 8 minutes):

1. the step rows (``bench_decode``): the dense and the MoE model's decode step, eager and
   captured, against the HBM bound, at batch 1 / 32 / 128 / 256 (table c);
2. the engine rows (``bench_engine``, table c2), most wanted first: each model's compiled
   engine (every bucket compiled at start-up), with the profiler window (``bench_profile``,
   table c3) at batch 128 on the dense one; then MTP k=3 on the dense model; then the eager
   dense engine; then MTP on the MoE model.

An engine whose estimated cost (start-up: ``COMPILE_S`` per compiled graph; ``ROW_S`` per
row) does not fit in what is left of the budget is not started: its rows say so (the hard
limit would otherwise stop the stage in the middle of a compilation). The dry run (CPU):
toy models at batch 2, eager engines only, the profiler window at batch 2.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch

from tests.gpu import bench_decode as D
from tests.gpu import bench_engine as E
from tests.gpu import bench_profile as F
from tests.gpu.common import Deadline, Report

ENGINES = [
    E.EngineSpec("dense", "default", True, (1, 32, 128, 256)),
    E.EngineSpec("moe", "default", True, (1, 32, 128, 256)),
    E.EngineSpec("dense", "mtp", True, (32, 128)),
    E.EngineSpec("dense", "default", False, (1, 32, 128, 256)),
    E.EngineSpec("moe", "mtp", True, (32,)),
]
DRY_ENGINES = [
    E.EngineSpec("dense", "default", False, (2,)),
    E.EngineSpec("moe", "default", False, (2,)),
    E.EngineSpec("dense", "mtp", False, (2,)),
]
PROFILE_AT, DRY_PROFILE_AT = ("dense", "default", 128), ("dense", "default", 2)
COMPILE_S, ROW_S, BUILD_S = 25.0, 10.0, 10.0  # estimates on an H200 (compiled rows)


def estimate_s(spec: E.EngineSpec) -> float:
    """Start-up (a decode graph per bucket; MTP adds a verify graph and a draft chain) + rows."""
    graphs = len(spec.batches) * (3 if spec.mode == "mtp" else 1) if spec.compiled else 0
    return BUILD_S + COMPILE_S * graphs + ROW_S * len(spec.batches)


def step_rows(
    path: Path | None,
    title: str,
    deadline: Deadline,
    benches: dict[str, D.Bench],
    device: torch.device,
    dtype: torch.dtype,
    bandwidth_gbs: float,
    batches: list[int],
) -> tuple[Report, dict[tuple[str, int], E.StepFigures]]:
    report = Report(path, title, D.COLUMNS)
    figures: dict[tuple[str, int], E.StepFigures] = {}
    iters = 10 if device.type == "cuda" else 1
    for name, bench in benches.items():
        params = sum(p.numel() for p in bench.model.parameters())
        report.note(f"{name}: {params / 1e6:,.0f}M parameters, {str(dtype).replace('torch.', '')}")
        for batch in batches:
            if deadline.passed():
                report.row(name, None, batch, *[None] * (len(D.COLUMNS) - 4), "skipped: stage time limit", ok=False)
                continue
            try:
                row = D.step_row(name, bench, batch, device, dtype, bandwidth_gbs, iters)
            except Exception as exc:
                traceback.print_exc()
                report.row(
                    name, None, batch, *[None] * (len(D.COLUMNS) - 4), f"{type(exc).__name__}: {exc}"[:160], ok=False
                )
                continue
            report.row(*row.cells, ok=row.ok)
            figures[name, batch] = E.StepFigures(row.bound_tok_s, row.graph_tok_s)
    return report, figures


def engine_table(
    path: Path | None,
    suffix: str,
    deadline: Deadline,
    benches: dict[str, D.Bench],
    device: torch.device,
    dtype: torch.dtype,
    figures: dict[tuple[str, int], E.StepFigures],
    out_dir: Path | None,
) -> tuple[Report, list[F.ProfileResult]]:
    dry = device.type == "cpu"
    report = Report(path, "(c2) the engine: Engine.step decoding, tok/s and host CPU per step" + suffix, E.COLUMNS)
    report.note(
        f"Prompts of {E.DRY_PROMPT if dry else E.ENGINE_PROMPT} tokens; a window of {E.ENGINE_STEPS} "
        "steps once every request decodes (cluster/bench/host_overhead.py's measure). Host CPU: "
        "process CPU - the model's calls - the sampler's decide (it holds the step's device "
        "sync, a spin-wait: its own column)."
    )
    profile_at = DRY_PROFILE_AT if dry else PROFILE_AT
    profiles: list[F.ProfileResult] = []

    def maybe_profile(spec: E.EngineSpec, engine: Any, batch: int, settings: Any) -> None:
        if (spec.model, spec.mode, batch) == profile_at and spec.compiled != dry:
            try:
                profiles.append(F.profile_window(engine, spec.mode, batch, settings, out_dir))
            except Exception:  # the engine rows stand without the profile
                traceback.print_exc()
                E.abort_all(engine)

    for spec in DRY_ENGINES if dry else ENGINES:
        need = estimate_s(spec)
        if deadline.remaining() < need:
            for batch in spec.batches:
                report.row(
                    spec.model,
                    spec.label,
                    batch,
                    *[None] * (len(E.COLUMNS) - 4),
                    f"skipped: needs ~{need:.0f} s, {max(deadline.remaining(), 0):.0f} s left",
                    ok=False,
                )
            continue
        E.engine_rows(
            report,
            benches[spec.model],
            spec,
            device,
            dtype,
            figures,
            after_batch=lambda engine, batch, settings, spec=spec: maybe_profile(spec, engine, batch, settings),
        )
        E.free_device_memory()
    return report, profiles


def profile_table(path: Path | None, suffix: str, profiles: list[F.ProfileResult]) -> Report:
    report = Report(path, "(c3) profiler window: the ops with the most self time per step" + suffix, F.COLUMNS)
    for result in profiles:
        where = result.trace.name if result.trace is not None else "not written (no --out)"
        report.note(f"Batch {result.batch}, {result.steps} steps; trace: {where}")
        for row in result.rows:
            report.row(*row)
    if not profiles:
        report.note("no profile was taken (its engine did not run)")
    return report


def run(
    path: Path | None, title: str, deadline: Deadline, dry_run: bool, bandwidth_gbs: float, out_dir: Path | None
) -> int:
    """Every table of the stage; returns the number of failed rows."""
    device = torch.device("cpu" if dry_run else "cuda")
    dtype = torch.float32 if dry_run else torch.bfloat16
    benches = {name: D.build(dims, device, dtype) for name, dims in (D.TOY_MODELS if dry_run else D.MODELS).items()}
    steps, figures = step_rows(
        path, title, deadline, benches, device, dtype, bandwidth_gbs, D.TOY_BATCHES if dry_run else D.BATCHES
    )
    steps.note(f"Bound at {bandwidth_gbs:,.0f} GB/s.")
    suffix = " -- DRY RUN (CPU, toy sizes)" if dry_run else ""
    engines, profiles = engine_table(path, suffix, deadline, benches, device, dtype, figures, out_dir)
    profiled = profile_table(path, suffix, profiles)
    return steps.failures + engines.failures + profiled.failures
