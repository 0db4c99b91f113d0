"""Stage (c)'s profiler window: ``PROFILE_STEPS`` steps of a steady decode through ``Engine.step``
under ``torch.profiler`` (CPU, and CUDA on a GPU; every thread, so the forward thread's ops
too). The trace goes to ``OUT/profile_b<batch>.json.gz`` (Perfetto or chrome://tracing), the
whole op table to ``OUT/profile_b<batch>.txt``, and the ops with the most self time, host and
device, per step, to the stage's table (c3).
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch

from cluster.bench import host_overhead as H

PROFILE_STEPS, TOP = 8, 12
COLUMNS = ["op", "calls/step", "self CPU us/step", "self device us/step"]


class ProfileResult(NamedTuple):
    batch: int
    steps: int
    trace: Path | None  # the gzipped chrome trace, when written
    rows: list[list[object]]  # COLUMNS, the top ops by self device and self CPU time


def _self_device_us(event: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def top_ops(events: Any, steps: int, top: int = TOP) -> list[list[object]]:
    """The ``top`` ops by self device time, then the ``top`` by self CPU time not yet listed."""
    by_device = sorted(events, key=_self_device_us, reverse=True)[:top]
    by_device = [e for e in by_device if _self_device_us(e) > 0]
    names = {e.key for e in by_device}
    by_cpu = [e for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True) if e.key not in names][:top]
    return [
        [e.key[:80], e.count / steps, e.self_cpu_time_total / steps, _self_device_us(e) / steps]
        for e in by_device + by_cpu
    ]


def _all_threads() -> Any:
    """Kineto's config that records every thread (the forward thread's ops) and, on CUDA, the
    syncs; None where this torch lacks it (the main thread's ops only)."""
    from torch._C._profiler import _ExperimentalConfig

    for wanted in ({"profile_all_threads": True, "enable_cuda_sync_events": True}, {"profile_all_threads": True}):
        try:
            return _ExperimentalConfig(**wanted)
        except TypeError:  # an older torch: without the option
            continue
    return None


def profile_window(engine: Any, mode: str, batch: int, settings: H.Settings, out_dir: Path | None) -> ProfileResult:
    """Admit ``batch`` requests, decode until steady, profile ``PROFILE_STEPS`` steps, drain."""
    from torch.profiler import ProfilerActivity, profile

    k = int(H.MODES[mode].get("spec", {}).get("num_draft_tokens", 0))
    ids = H.add_requests(engine, batch, settings, k)
    H.until_decoding(engine, ids, settings.admit_steps)
    for _ in range(settings.warmup):
        engine.step()
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, experimental_config=_all_threads()) as prof:
        for _ in range(PROFILE_STEPS):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    H.drain(engine, ids)
    events = prof.key_averages()
    trace = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        raw = out_dir / f"profile_b{batch}.json"
        prof.export_chrome_trace(str(raw))
        trace = raw.with_suffix(".json.gz")
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        (out_dir / f"profile_b{batch}.txt").write_text(events.table(sort_by=sort, row_limit=60) + "\n")
    return ProfileResult(batch, PROFILE_STEPS, trace, top_ops(events, PROFILE_STEPS))
