"""``hybridserve bench host-overhead``: the engine's host CPU per request and step, by phase.

    hybridserve bench host-overhead [--batch 1 8 32 128 256 512] [--modes default mtp]
        [--steps 30] [--warmup 5] [--json]

A near-null Qwen3-Next (hidden 32, one GDN and one attention layer, tiny heads and experts,
an MTP head) built into a temp dir, so the forward costs little and what remains is the
engine's host path. Per mode (``default``: the schema's defaults, overlap on, no speculation;
``mtp``: MTP k=3, overlap on) and batch size, one process, no Ray: ``batch`` token-id prompts
are added, the engine steps until every request has a token (all admitted and past
prefill), ``warmup`` more steps, then the measured window of ``steps`` calls of
``Engine.step`` (more at small batches: at least ``--min-request-steps`` request-steps).

Host CPU per request-step = (process CPU over the window - CPU inside the model's
computations, ``host_overhead_probe.FORWARD_PATHS``, - the probes' own cost) / (steps x
batch). Phases (``host_overhead_probe.PHASES``) are exclusive thread CPU times; ``other`` is
the rest of the host figure. MTP mode also reports sequences verified per step / batch, and
every mode the overlapped fraction (steps launched while the step before was in flight /
steps). Torch runs one intra-op thread: a second thread's share of a forward would count as
host time. With ``--json`` the last line of stdout is the whole result
(``host_us_per_request_step``: the default mode's figure per batch size).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.bench.host_overhead_probe import FORWARD, Probe, resolve, wrapper_cost_s

NULL_MODEL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    intermediate_size=32,
    mlp_only_layers=[0],
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    max_position_embeddings=16384,
)
MODES: dict[str, dict[str, Any]] = {"default": {}, "mtp": {"spec": {"method": "mtp", "num_draft_tokens": 3}}}
BATCHES = (1, 8, 32, 128, 256, 512)
PAGE_SIZE = 16
BATCH_SOURCE = "scheduler.schedule"  # returns the launched batch (``.seqs``) or None
OVERLAP_COUNTER = "hybridserve_overlapped_steps_total"


@dataclass(frozen=True)
class Point:
    """One (mode, batch) measurement; ``*_us_per_request_step`` divide by steps x batch."""

    mode: str
    batch: int
    steps: int
    host_us_per_request_step: float
    host_us_per_step: float
    forward_us_per_step: float
    phases_us_per_request_step: dict[str, float]  # every present phase, and "other"
    probe_us_per_step: float  # the wrappers' own cost, subtracted
    verified_per_request_step: float  # sequences with is_verify / (steps x batch)
    launches_per_step: float  # steps whose schedule launched a batch
    overlapped_fraction: float
    tokens_per_request_step: float
    wall_ms_per_step: float
    compiled_steps: int
    eager_steps: int


@dataclass(frozen=True)
class Settings:
    batches: tuple[int, ...] = BATCHES
    modes: tuple[str, ...] = tuple(MODES)
    steps: int = 30
    warmup: int = 5
    min_request_steps: int = 512
    device: str = "cpu"
    seed: int = 0
    prompt_len: int = 8
    admit_steps: int = 16  # steps allowed for every request to get its first token

    def steps_for(self, batch: int) -> int:
        return max(self.steps, math.ceil(self.min_request_steps / batch))

    def check(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ValueError(f"unknown modes {bad}; use {list(MODES)}")
        if not self.batches or min(self.batches) < 1 or self.steps < 1 or self.warmup < 0:
            raise ValueError(
                f"batches {list(self.batches)} must be >= 1, steps {self.steps} >= 1, warmup {self.warmup} >= 0"
            )


def build_model(out_dir: Path) -> Path:
    from tools.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3_next", out_dir, seed=0, mtp=True, **NULL_MODEL)


def max_tokens(settings: Settings, batch: int, k: int) -> int:
    """Enough that no request finishes before its window ends (k + 1 tokens a step at most)."""
    return (settings.admit_steps + settings.warmup + settings.steps_for(batch) + 2) * (k + 1)


def build_engine(model_dir: Path, mode: str, settings: Settings) -> Any:
    from configs.schema import load_config
    from workers.engine import Engine

    k = int(MODES[mode].get("spec", {}).get("num_draft_tokens", 0))
    tokens = max(b * (settings.prompt_len + max_tokens(settings, b, k) + k + PAGE_SIZE) for b in settings.batches)
    biggest = max(settings.batches)
    overrides = dict(
        model=str(model_dir),
        device=settings.device,
        dtype="float32",
        cache={"page_size": PAGE_SIZE, "max_kv_tokens": tokens},
        scheduler={
            "max_running_requests": biggest,
            "max_batch_tokens": max(4096, biggest * max(settings.prompt_len, k + 1)),
        },
        **MODES[mode],
    )
    return Engine(load_config(overrides=overrides))


class BatchCounter:
    """Counts launched batches and their verify sequences, around ``BATCH_SOURCE``."""

    def __init__(self, engine: Any, count_verifies: bool) -> None:
        self.launches = self.verifies = 0
        found = resolve(engine, BATCH_SOURCE)
        self.present = found is not None
        if found is None:
            return
        owner, name = found
        inner = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            batch = inner(*args, **kwargs)
            if batch is not None:
                self.launches += 1
                if count_verifies:
                    self.verifies += sum(1 for s in batch.seqs if getattr(s, "is_verify", False))
            return batch

        setattr(owner, name, counted)

    def reset(self) -> None:
        self.launches = self.verifies = 0


def _counters(engine: Any) -> tuple[int, int, int, int]:
    """(overlapped launches, compiled steps, eager steps, generated tokens) so far."""
    stats = engine.stats
    overlapped = stats.counters.get(OVERLAP_COUNTER, getattr(engine, "num_overlapped_launches", 0))
    steps = stats.labelled.get("hybridserve_engine_steps_total", {})
    return (
        int(overlapped),
        int(steps.get("compiled", 0)),
        int(steps.get("eager", 0)),
        int(stats.counters.get("hybridserve_generation_tokens_total", 0)),
    )


def add_requests(engine: Any, batch: int, settings: Settings, k: int) -> list[str]:
    from workers.sampling.params import SamplingParams

    rng = random.Random(settings.seed + batch)
    params = SamplingParams(max_tokens=max_tokens(settings, batch, k), temperature=0.0, ignore_eos=True)
    ids = [f"ho-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, engine.vocab_size - 8) for _ in range(settings.prompt_len)], params)
    return ids


def until_decoding(engine: Any, ids: list[str], max_steps: int) -> None:
    """Step until every request has an output token: all admitted and past prefill."""
    waiting = set(ids)
    for _ in range(max_steps):
        for out in engine.step():
            if getattr(out, "new_token_ids", True):
                waiting.discard(out.request_id)
        if not waiting:
            return
    raise RuntimeError(f"{len(waiting)} of {len(ids)} requests had no token after {max_steps} steps")


def drain(engine: Any, ids: list[str]) -> None:
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def measure(
    engine: Any, probe: Probe, counter: BatchCounter, mode: str, batch: int, settings: Settings, wrapper_s: float
) -> Point:
    k = int(MODES[mode].get("spec", {}).get("num_draft_tokens", 0))
    ids = add_requests(engine, batch, settings, k)
    until_decoding(engine, ids, settings.admit_steps)
    for _ in range(settings.warmup):
        engine.step()
    steps = settings.steps_for(batch)
    before = _counters(engine)
    probe.reset()
    counter.reset()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    totals = probe.totals()
    after = _counters(engine)
    drain(engine, ids)
    forward = totals.seconds.pop(FORWARD, 0.0)
    probe_s = totals.calls * wrapper_s
    host = max(cpu - forward - probe_s, 0.0)
    per_req = 1e6 / (steps * batch)
    phases = {
        p: round(totals.seconds.get(p, 0.0) * per_req, 3) for p in probe.table if p != FORWARD and p not in probe.absent
    }  # in the table's order
    phases["other"] = round(max(host - sum(totals.seconds.values()), 0.0) * per_req, 3)
    return Point(
        mode,
        batch,
        steps,
        round(host * per_req, 3),
        round(host * 1e6 / steps, 1),
        round(forward * 1e6 / steps, 1),
        phases,
        round(probe_s * 1e6 / steps, 1),
        round(counter.verifies / (steps * batch), 4),
        round(counter.launches / steps, 4),
        round((after[0] - before[0]) / steps, 4),
        round((after[3] - before[3]) / (steps * batch), 4),
        round(wall * 1e3 / steps, 3),
        after[1] - before[1],
        after[2] - before[2],
    )


def run_points(settings: Settings, model_dir: Path | None = None, log: Any = None) -> dict[str, Any]:
    """Every (mode, batch) point; the JSON-ready result (see the module docstring)."""
    import torch

    settings.check()
    torch.set_num_threads(1)  # a forward's second thread would count as host time
    load_start = os.getloadavg()
    wrapper_s = wrapper_cost_s()
    points: list[Point] = []
    absent: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="hybridserve-host-") as tmp:
        model = model_dir or build_model(Path(tmp) / "null-qwen3-next")
        for mode in settings.modes:
            engine = build_engine(model, mode, settings)
            try:
                probe = Probe(engine)
                with probe.installed():
                    counter = BatchCounter(engine, count_verifies=mode == "mtp")
                    absent[mode] = probe.absent + ([] if counter.present else ["batches"])
                    for batch in settings.batches:
                        points.append(measure(engine, probe, counter, mode, batch, settings, wrapper_s))
                        if log is not None:
                            log(format_point(points[-1]))
            finally:
                engine.runner.shutdown()
    return summarize(points, settings, absent, wrapper_s, load_start, os.getloadavg())


def summarize(
    points: list[Point],
    settings: Settings,
    absent: dict[str, list[str]],
    wrapper_s: float,
    load_start: tuple[float, ...],
    load_end: tuple[float, ...],
) -> dict[str, Any]:
    def by_batch(mode: str, field: str) -> dict[str, Any]:
        return {str(p.batch): getattr(p, field) for p in points if p.mode == mode}

    out: dict[str, Any] = {
        "host_us_per_request_step": by_batch("default", "host_us_per_request_step"),
        "host_us_per_step": by_batch("default", "host_us_per_step"),
    }
    for mode in settings.modes:
        out[mode] = {
            f: by_batch(mode, f)
            for f in (
                "host_us_per_request_step",
                "host_us_per_step",
                "phases_us_per_request_step",
                "verified_per_request_step",
                "overlapped_fraction",
                "tokens_per_request_step",
            )
        }
    out.update(
        absent_phases=absent,
        points=[asdict(p) for p in points],
        settings=asdict(settings),
        wrapper_us=round(wrapper_s * 1e6, 3),
        loadavg_start=load_start,
        loadavg_end=load_end,
    )
    return out


def format_point(p: Point) -> str:
    phases = " ".join(f"{k} {v:.1f}" for k, v in p.phases_us_per_request_step.items())
    return (
        f"{p.mode:>7} B={p.batch:<4} host {p.host_us_per_request_step:7.2f} us/req-step "
        f"({p.host_us_per_step / 1e3:.2f} ms/step; {phases}); forward {p.forward_us_per_step / 1e3:.2f} "
        f"ms/step; verified {p.verified_per_request_step:.2f}, overlapped {p.overlapped_fraction:.2f}, "
        f"tokens {p.tokens_per_request_step:.2f}/req-step; wall {p.wall_ms_per_step:.2f} ms/step, "
        f"{p.steps} steps"
    )


def add_args(p: argparse.ArgumentParser | Any) -> None:
    """The options (``hybridserve bench host-overhead`` adds them as a group)."""
    p.add_argument(
        "--batch", dest="batches", type=int, nargs="+", default=list(BATCHES), help="batch sizes (host-overhead)"
    )
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="host-overhead modes")
    p.add_argument("--steps", type=int, default=Settings.steps, help="measured steps per point (at least)")
    p.add_argument("--warmup", type=int, default=Settings.warmup, help="steps after every request decodes")
    p.add_argument(
        "--min-request-steps",
        type=int,
        default=Settings.min_request_steps,
        help="small batches run more steps: at least this many request-steps",
    )
    p.add_argument("--device", default="cpu", help="host-overhead: the engine's device")
    p.add_argument("--json", action="store_true", help="the last line of stdout is the result as JSON")


def run(args: argparse.Namespace) -> int:
    """Shared by ``main`` and ``hybridserve bench host-overhead`` (whose ``--model``, ``--out``
    and ``--seed`` are the bench command's own: a checkpoint dir, the JSON file, the prompts' seed)."""
    seed = getattr(args, "seed", None)
    settings = Settings(
        tuple(args.batches),
        tuple(args.modes),
        args.steps,
        args.warmup,
        args.min_request_steps,
        args.device,
        0 if seed is None else seed,
    )
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    model = Path(args.model) if getattr(args, "model", None) else None
    if model is not None and not (model / "config.json").exists():
        raise ValueError(f"--model {str(model)!r} has no config.json")
    result = run_points(settings, model, log=log)
    if getattr(args, "out", None):
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(parser)
    parser.add_argument("--model", default=None, help="a checkpoint dir instead of the null model")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    parser.add_argument("--seed", type=int, default=None, help="the prompts' seed")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
