"""Stage (c)'s engine rows: ``Engine.step`` decoding on the stage's models (``bench_decode``),
measured as ``hybridserve bench host-overhead`` measures (``cluster/bench/host_overhead.py``).

One engine per (model, mode, compiled), built around the model already on the device, serves
every batch size of its rows in turn: ``batch`` prompts of ``ENGINE_PROMPT`` tokens (so the
measured window decodes at about the step rows' context), steps until every request has a
token, ``ENGINE_WARM`` more, then a window of ``ENGINE_STEPS`` steps. Per row: tok/s over the
window against the captured step and the bound of the step rows; compiled / eager steps in the
window (``hybridserve_engine_steps_total``); tokens, verifies and overlapped steps per step;
and host CPU per step: process CPU - the model's own calls - the probes' cost. On a GPU the
step's one device read happens in the sampler's ``decide`` (forward thread), and a CUDA sync
spins, so its CPU time holds the device's wait: the ``sampling+sync`` column, left out of
``host``. ``mtp`` mode: k=3 with random MTP weights (``add_random_mtp``), so drafts are
rarely accepted; what the rows show is the verify's cost and whether every request verifies
every step under overlap.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from cluster.bench import host_overhead as H
from cluster.bench.host_overhead_probe import Probe, wrapper_cost_s
from tests.gpu.bench_decode import PAGE_SIZE, Bench
from tests.gpu.common import Report

ENGINE_PROMPT, ENGINE_WARM, ENGINE_STEPS = 480, 4, 32
DRY_PROMPT = 32
COLUMNS = [
    "model",
    "mode",
    "batch",
    "start-up s",
    "engine tok/s",
    "engine ÷ graph",
    "engine % bound",
    "window steps compiled/eager",
    "tokens/req-step",
    "verified/req-step",
    "overlapped",
    "host us/step",
    "host us/req-step",
    "sampling+sync us/step",
    "host phases us/step",
]


class EngineSpec(NamedTuple):
    model: str  # a key of bench_decode.MODELS
    mode: str  # a key of host_overhead.MODES
    compiled: bool
    batches: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.mode}, {'compiled' if self.compiled else 'eager'}"


def add_random_mtp(model: Any, seed: int = 1) -> None:
    """Random ``mtp.*`` tensors for a model built in memory: one MTP layer shaped like its
    first full-attention layer (the checkpoint layout ``add_qwen_mtp`` writes), drawn on the
    model's device."""
    from tools.tiny import redraw_

    cfg, device = model.config, model.model.embedding.weight.device
    prefix = f"model.layers.{list(cfg.layer_types).index('full_attention')}."
    shapes = {
        f"mtp.layers.0.{n[len(prefix) :]}": t.shape for n, t in model.weight_targets().items() if n.startswith(prefix)
    }
    h = cfg.hidden_size
    shapes.update(
        {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        }
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    with torch.no_grad():
        for name, shape in shapes.items():
            weights[name] = torch.empty(shape, dtype=model.dtype, device=device)
            redraw_(name, weights[name], gen, zero_centered_norms=True)
    model.mtp_weights = weights


def settings_for(spec: EngineSpec, device: torch.device) -> H.Settings:
    dry = device.type == "cpu"
    return H.Settings(
        batches=spec.batches,
        modes=(spec.mode,),
        steps=ENGINE_STEPS,
        warmup=ENGINE_WARM,
        min_request_steps=1,
        device=device.type,
        prompt_len=DRY_PROMPT if dry else ENGINE_PROMPT,
        admit_steps=64,
    )


def build_engine(bench: Bench, spec: EngineSpec, settings: H.Settings, dtype: torch.dtype) -> Any:
    """The engine over ``bench.model`` (its compiled steps, when asked, compiled here)."""
    from configs.schema import load_config
    from workers.engine import Engine
    from workers.loader import LoadedModel

    loaded = LoadedModel(bench.model, bench.hf_config)
    engine_cls = type("PrebuiltEngine", (Engine,), {"_load_model": lambda self, _dir: loaded})
    k = int(H.MODES[spec.mode].get("spec", {}).get("num_draft_tokens", 0))
    biggest = max(spec.batches)
    per_request = settings.prompt_len + H.max_tokens(settings, biggest, k) + k + PAGE_SIZE
    config = load_config(
        overrides=dict(
            model=str(bench.model_dir),
            device=settings.device,
            dtype=str(dtype).replace("torch.", ""),
            cache={
                "page_size": PAGE_SIZE,
                "max_kv_tokens": biggest * per_request,
                "enable_prefix_cache": False,
                "max_mamba_slots": biggest + 8,
            },
            scheduler={"max_running_requests": biggest, "max_batch_tokens": 16384, "chunked_prefill_size": 4096},
            compile={"enabled": spec.compiled, "batch_sizes": sorted(spec.batches)},
            **H.MODES[spec.mode],
        )
    )
    if k and not bench.model.mtp_weights:
        add_random_mtp(bench.model)
    return engine_cls(config)


def free_device_memory() -> None:
    """After an engine is gone: free what its compiled steps held (graphs, dynamo's caches)."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def abort_all(engine: Any) -> None:
    """Abort every request and step until nothing is in flight (after a failed row)."""
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


class StepFigures(NamedTuple):
    """What the step rows found per (model, batch): the bound and the captured step."""

    bound_tok_s: float
    graph_tok_s: float | None


def engine_rows(
    report: Report,
    bench: Bench,
    spec: EngineSpec,
    device: torch.device,
    dtype: torch.dtype,
    steps: dict[tuple[str, int], StepFigures],
    after_batch: Callable[[Any, int, H.Settings], None] | None = None,
) -> None:
    """One row per batch of ``spec``; a failure is a row naming it (the next rows still run)."""
    settings = settings_for(spec, device)
    t0 = time.perf_counter()
    try:
        engine = build_engine(bench, spec, settings, dtype)
    except Exception as exc:
        traceback.print_exc()
        for batch in spec.batches:
            report.row(
                spec.model,
                spec.label,
                batch,
                *[None] * (len(COLUMNS) - 4),
                f"engine failed: {type(exc).__name__}: {exc}"[:160],
                ok=False,
            )
        return
    startup_s = time.perf_counter() - t0
    try:
        _measure_rows(report, engine, spec, settings, startup_s, steps, after_batch)
    finally:
        engine.runner.shutdown()


def _measure_rows(
    report: Report,
    engine: Any,
    spec: EngineSpec,
    settings: H.Settings,
    startup_s: float,
    steps: dict[tuple[str, int], StepFigures],
    after_batch: Callable[[Any, int, H.Settings], None] | None,
) -> None:
    probe = Probe(engine)
    with probe.installed():
        counter = H.BatchCounter(engine, count_verifies=spec.mode == "mtp")
        wrapper_s = wrapper_cost_s()
        for batch in spec.batches:
            try:
                point = H.measure(engine, probe, counter, spec.mode, batch, settings, wrapper_s)
            except Exception as exc:
                traceback.print_exc()
                report.row(
                    spec.model,
                    spec.label,
                    batch,
                    startup_s,
                    *[None] * (len(COLUMNS) - 5),
                    f"{type(exc).__name__}: {exc}"[:160],
                    ok=False,
                )
                abort_all(engine)  # raises if the engine cannot recover: no more rows
                continue
            report.row(*cells(spec, point, startup_s, steps.get((spec.model, batch))))
            if after_batch is not None:
                after_batch(engine, batch, settings)


def cells(spec: EngineSpec, p: H.Point, startup_s: float, figures: StepFigures | None) -> list[object]:
    tok_s = p.tokens_per_request_step * p.batch * 1e3 / p.wall_ms_per_step
    graph = figures.graph_tok_s if figures is not None else None
    bound = figures.bound_tok_s if figures is not None else None
    sampling = p.phases_us_per_request_step.get("sampling", 0.0) * p.batch
    host = max(p.host_us_per_step - sampling, 0.0)
    phases = " / ".join(f"{k} {v * p.batch:,.0f}" for k, v in p.phases_us_per_request_step.items() if k != "sampling")
    return [
        spec.model,
        spec.label,
        p.batch,
        startup_s,
        tok_s,
        None if not graph else f"{tok_s / graph:.2f}",
        None if not bound else f"{100 * tok_s / bound:.1f}%",
        f"{p.compiled_steps}/{p.eager_steps}",
        p.tokens_per_request_step,
        p.verified_per_request_step,
        p.overlapped_fraction,
        host,
        host / p.batch,
        sampling,
        phases,
    ]
