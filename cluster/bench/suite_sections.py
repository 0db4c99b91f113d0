"""The suite's measurements, one function per comparison; each returns a plain dict.

In-process (no Ray): ``overlap``, ``spec``, ``vs_transformers``, ``host_overhead``. Through HTTP on a local
Serve cluster: ``serving`` (decode efficiency against a bare loop, prefix cache on/off)
and ``routing`` (three routers on the same replica config and workload). Pure Python:
``simulation``. Timed comparisons interleave their two sides and keep each side's best
of ``repeats`` (other load on a shared machine only slows a run down).
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from cluster.bench import inproc, proc_cpu
from cluster.bench.client import LoadSettings, Target, run_benchmark
from cluster.bench.suite_config import SuiteConfig
from cluster.bench.workloads import RandomSpec, Renderer, Workload, build, load_workload
from configs.schema import HybridServeConfig, SpecConfig

REPLICA = {"num_cpus": 1, "stats_interval_s": 0.25, "events_interval_s": 0.02}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(16, 500) for _ in range(n)]


def _best(samples: list[float], higher_is_better: bool = True) -> float:
    return max(samples) if higher_is_better else min(samples)


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


# -- in-process ---------------------------------------------------------------------------------
def overlap(cfg: SuiteConfig, model: Path) -> dict[str, Any]:
    from workers.llm import LLM

    c = cfg.overlap
    rng = random.Random(1)
    prompts = [_ids(rng, c.prompt_len) for _ in range(c.batch)]
    llms = {
        on: LLM(
            model=str(model),
            **inproc.engine_kwargs(cfg.compile, c.batch),
            cache={"max_kv_tokens": 16384},
            scheduler={"overlap": on, "max_running_requests": max(64, c.batch)},
        )
        for on in (True, False)
    }
    samples = inproc.interleaved(
        {
            f"overlap_{'on' if on else 'off'}": (lambda llm=llm: inproc.throughput_run(llm, prompts, c.output_len))
            for on, llm in llms.items()
        },
        c.repeats or cfg.repeats,
    )
    on, off = _best(samples["overlap_on"]), _best(samples["overlap_off"])
    return {
        "overlap_speedup": _r(on / off),
        "tok_s_on": _r(on, 1),
        "tok_s_off": _r(off, 1),
        "samples_tok_s": {k: [_r(v, 1) for v in vs] for k, vs in samples.items()},
        "batch": c.batch,
        "prompt_len": c.prompt_len,
        "output_len": c.output_len,
        "model": str(model),
    }


def spec_model(cfg: SuiteConfig) -> tuple[Path, bool]:
    """(model dir, whether it is the trained default) -- the fallback when it is absent."""
    trained = HybridServeConfig(model=cfg.spec_model).model_dir()
    if (trained / "config.json").exists() and _has_mtp(trained):
        return trained, True
    return HybridServeConfig(model=cfg.spec_fallback_model).model_dir(), False


def _has_mtp(model_dir: Path) -> bool:
    from safetensors import safe_open

    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            if any(k.startswith("mtp.") for k in st.keys()):
                return True
    return False


def spec(cfg: SuiteConfig) -> dict[str, Any]:
    from workers.llm import LLM

    model, trained = spec_model(cfg)
    default_k = SpecConfig().num_draft_tokens
    ks = [default_k] + [k for k in cfg.spec.sweep if k != default_k]
    engine = inproc.engine_kwargs(cfg.compile, 1)
    llms = {"off": LLM(model=str(model), **engine)}
    for k in ks:
        llms[f"k{k}"] = LLM(model=str(model), **engine, spec={"method": "mtp", "num_draft_tokens": k})
    prompts = [llms["off"].encode(p) for p in cfg.spec.prompts]
    # Interleaved per prompt (off, k, k', ... on the same prompt back to back), so every
    # variant sees the same moments of the machine; best per (variant, prompt), then the
    # mean over prompts.
    samples: dict[str, list[list[float]]] = {name: [[] for _ in prompts] for name in llms}
    for _ in range(cfg.spec.repeats or cfg.repeats):
        for i, p in enumerate(prompts):
            for name, llm in llms.items():
                samples[name][i].append(inproc.tpot_run(llm, [p], cfg.spec.output_len))
    best = {name: sum(min(v) for v in per) / len(per) for name, per in samples.items()}
    return {
        "spec_tpot_speedup": _r(best["off"] / best[f"k{default_k}"]),
        "model": str(model),
        "trained_model": trained,
        "num_draft_tokens": default_k,
        "tpot_ms": {name: _r(1000 * v, 2) for name, v in best.items()},
        "speedup_by_k": {k: _r(best["off"] / best[f"k{k}"]) for k in ks},
        "acceptance_by_k": {k: inproc.spec_acceptance(llms[f"k{k}"]) for k in ks},
        "samples_tpot_ms": {n: [[_r(1000 * x, 2) for x in v] for v in per] for n, per in samples.items()},
        "output_len": cfg.spec.output_len,
        "num_prompts": len(prompts),
    }


def vs_transformers(cfg: SuiteConfig, model: Path) -> dict[str, Any]:
    from workers.llm import LLM

    c = cfg.vs_transformers
    rng = random.Random(2)
    prompts = [_ids(rng, rng.randint(c.min_prompt_len, c.max_prompt_len)) for _ in range(c.num_prompts)]
    llm = LLM(model=str(model), **inproc.engine_kwargs(cfg.compile, c.num_prompts), cache={"max_kv_tokens": 32768})
    hf = inproc.HFGenerate(model)
    samples = inproc.interleaved(
        {
            "run_batch_s": lambda: inproc.run_batch_seconds(llm, prompts, c.output_len),
            "hf_batched_s": lambda: hf.seconds(prompts, c.output_len),
        },
        cfg.repeats,
    )
    rb, hfb = _best(samples["run_batch_s"], False), _best(samples["hf_batched_s"], False)
    hf_seq = sum(hf.seconds([p], c.output_len) for p in prompts)  # once: it is slow
    out_tokens = c.num_prompts * c.output_len
    return {
        "vs_transformers_speedup": _r(hfb / rb),
        "vs_transformers_sequential_speedup": _r(hf_seq / rb),
        "run_batch_tok_s": _r(out_tokens / rb, 1),
        "hf_batched_tok_s": _r(out_tokens / hfb, 1),
        "hf_sequential_tok_s": _r(out_tokens / hf_seq, 1),
        "samples_s": {k: [_r(v, 3) for v in vs] for k, vs in samples.items()},
        "prompt_lens": [len(p) for p in prompts],
        "output_len": c.output_len,
        "model": str(model),
    }


def host_overhead(cfg: SuiteConfig) -> dict[str, Any]:
    """bench/host_overhead.py's result, plus the goals' keys: host us per step at batch 1,
    MTP's verifies and overlapped fraction at batch 32 (None where a batch was not run)."""
    from cluster.bench.host_overhead import Settings, run_points

    c = cfg.host_overhead
    out = run_points(Settings(tuple(c.batches), tuple(c.modes), c.steps, c.warmup, c.min_request_steps))
    mtp = out.get("mtp", {})
    out["goals"] = {
        "host_us_per_step_1": out["host_us_per_step"].get("1"),
        "mtp_verified_per_request_step_32": mtp.get("verified_per_request_step", {}).get("32"),
        "mtp_overlapped_fraction_32": mtp.get("overlapped_fraction", {}).get("32"),
    }
    return out


# -- through HTTP ----------------------------------------------------------------------------------
def _bench(app: Any, workload: Workload, load: LoadSettings, renderer: Renderer | None = None) -> Any:
    res = asyncio.run(run_benchmark(Target(app.base_url, timeout_s=300.0), workload, load, renderer))
    failed = [r.error for r in res.records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(res.records)} requests failed, first: {failed[0]}")
    return res


def _warm(app: Any) -> None:
    w = build(RandomSpec(num_prompts=2, input_len=24, output_len=4, range_ratio=0.0, seed=999))
    _bench(app, w, LoadSettings())


def serving(cfg: SuiteConfig, cluster: Any, model: Path) -> dict[str, Any]:
    from workers.llm import LLM

    engine = {
        **inproc.engine_kwargs(cfg.compile, cfg.serving_efficiency.batch),
        "model": str(model),
        "cache": {"max_kv_tokens": 16384},
    }
    on = cluster.deploy("bench-cache-on", engine, "hybrid_prefix", REPLICA)
    off = cluster.deploy(
        "bench-cache-off",
        {**engine, "cache": {"max_kv_tokens": 16384, "enable_prefix_cache": False}},
        "hybrid_prefix",
        REPLICA,
    )
    try:
        _warm(on)
        _warm(off)
        out: dict[str, Any] = {"deploy_s": _r(on.deploy_s + off.deploy_s, 1)}
        out["prefix_cache"] = _prefix_cache(cfg, on, off)
        llms = [
            LLM(
                model=str(model),
                **inproc.engine_kwargs(cfg.compile, cfg.serving_efficiency.batch),
                cache={"max_kv_tokens": 16384},
            )
            for _ in range(2)
        ]
        out["efficiency"] = _efficiency(cfg, on, *llms)
        return out
    finally:
        cluster.delete(on)
        cluster.delete(off)


def _efficiency(cfg: SuiteConfig, app: Any, bare_llm: Any, engine_llm: Any) -> dict[str, Any]:
    """HTTP and bare loop, interleaved; the in-process engine alongside, to split the gap
    into engine and HTTP/Ray shares (the bare loop writes the pools: its own LLM)."""
    c = cfg.serving_efficiency
    seeds = iter(range(100, 200))

    def engine() -> float:
        rng = random.Random(next(seeds))
        records, _ = inproc.engine_records(engine_llm, [_ids(rng, c.prompt_len) for _ in range(c.batch)], c.output_len)
        return c.batch * len(records) / sum(r.tpot or 0.0 for r in records)

    pids = {"client": {os.getpid()}, "replica": _replica_pids(app)}
    http_cpu: list[dict[str, float]] = []  # per HTTP sample: CPU ms per token by process

    def http() -> float:
        w = build(
            RandomSpec(
                num_prompts=c.batch, input_len=c.prompt_len, output_len=c.output_len, range_ratio=0.0, seed=next(seeds)
            )
        )
        before = proc_cpu.snapshot(with_threads=False)
        res = _bench(app, w, LoadSettings(max_concurrency=c.batch))
        delta = proc_cpu.cpu_delta(before, proc_cpu.snapshot(with_threads=False))
        http_cpu.append(proc_cpu.ms_per_unit_by_role(delta, sum(r.output_tokens for r in res.records), pids))
        return c.batch / (res.metrics.tpot_ms.mean / 1000)  # tok/s = batch / mean TPOT

    def bare() -> float:
        rng = random.Random(next(seeds))
        return inproc.bare_decode_rate(bare_llm, [_ids(rng, c.prompt_len) for _ in range(c.batch)], c.output_len)

    samples = inproc.interleaved({"http_tok_s": http, "bare_tok_s": bare, "engine_tok_s": engine}, cfg.repeats)
    h, b, e = (_best(samples[k]) for k in ("http_tok_s", "bare_tok_s", "engine_tok_s"))
    return {
        "serving_efficiency": _r(h / b),
        "http_decode_tok_s": _r(h, 1),
        "bare_decode_tok_s": _r(b, 1),
        "engine_decode_tok_s": _r(e, 1),
        "engine_over_bare": _r(e / b),
        "http_over_engine": _r(h / e),
        "http_cpu_ms_per_token": http_cpu[samples["http_tok_s"].index(h)],  # of the best HTTP sample
        "samples": {k: [_r(v, 1) for v in vs] for k, vs in samples.items()},
        "batch": c.batch,
        "prompt_len": c.prompt_len,
        "output_len": c.output_len,
    }


def _replica_pids(app: Any) -> set[int]:
    """The engine replicas' processes (``/debug/replicas``), to name them in CPU splits."""
    import httpx

    reps = httpx.get(f"{app.base_url}/debug/replicas", timeout=30.0, trust_env=False).json()["replicas"]
    return {int(r["pid"]) for r in reps if r.get("pid")}


def _prefix_cache(cfg: SuiteConfig, on: Any, off: Any) -> dict[str, Any]:
    c = cfg.prefix_cache
    w = load_workload(c.workload, c.overrides)
    n = len(w.sessions)
    bounds = [n * i // c.chunks for i in range(c.chunks + 1)]
    records: dict[str, list[Any]] = {"on": [], "off": []}
    for lo, hi in zip(bounds, bounds[1:]):  # alternate, chunk by chunk
        part = replace(w, sessions=w.sessions[lo:hi])
        for name, app in (("on", on), ("off", off)):
            records[name] += _bench(app, part, LoadSettings(max_concurrency=c.max_concurrency)).records
    floor = build(RandomSpec(num_prompts=8, input_len=c.floor_prompt_len, output_len=1, range_ratio=0.0, seed=7))
    floor_ms = _bench(off, floor, LoadSettings(max_concurrency=1)).metrics.ttft_ms.mean
    prompt = {k: sum(r.prompt_tokens for r in v) for k, v in records.items()}
    cached = {k: sum(r.cached_tokens for r in v) for k, v in records.items()}
    ttft = {k: sum(r.ttft for r in v) / len(v) for k, v in records.items()}
    return {
        "prefix_cache_prefill_fraction": _r(1 - cached["on"] / prompt["on"]),
        "prefix_cache_ttft_ratio": _r(ttft["on"] / ttft["off"]),
        "mean_ttft_ms": {k: _r(1000 * v, 1) for k, v in ttft.items()},
        "ttft_floor_ms": _r(floor_ms, 1),
        "floor_prompt_len": c.floor_prompt_len,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "num_requests": n,
        "workload": c.workload,
        "overrides": c.overrides,
        "max_concurrency": c.max_concurrency,
    }


def routing(cfg: SuiteConfig, cluster: Any) -> dict[str, Any]:
    from cluster.bench.serving import counter_deltas, wait_for_counters

    c = cfg.routing
    engine = {**inproc.CPU, **c.engine, "model": c.model, "parallel": {"num_replicas": c.num_replicas}}
    per_replica_cache = int(HybridServeConfig.model_validate(engine).cache.max_kv_tokens or 32768)
    w = load_workload(c.workload, {"cluster_cache_tokens": per_replica_cache * c.num_replicas, **c.overrides})
    renderer = Renderer.from_path(HybridServeConfig(model=c.model).model_dir())
    results: dict[str, Any] = {}
    for router in ("hybrid_prefix", "round_robin", "ray_prefix"):
        app = cluster.deploy(f"route-{router.replace('_', '-')}", engine, router, REPLICA)
        try:
            if w.warmup:
                _bench(
                    app,
                    replace(w, sessions=w.warmup, warmup=[]),
                    LoadSettings(max_concurrency=c.max_concurrency),
                    renderer,
                )
            before = wait_for_counters(app.metrics_url, "hybridserve_requests_total", len(w.warmup))
            res = _bench(
                app, replace(w, warmup=[]), LoadSettings(rate=c.rate, max_concurrency=c.max_concurrency), renderer
            )
            total = sum(v.get("hybridserve_requests_total", 0.0) for v in before.values()) + len(res.records)
            after = wait_for_counters(app.metrics_url, "hybridserve_requests_total", total)
            per = counter_deltas(before, after, "hybridserve_requests_total")
            m = res.metrics
            results[router] = {
                "cached_fraction": _r(m.cached_fraction, 4),
                "requests_per_replica": per,
                "load_max_min": _r(max(per.values()) / max(min(per.values()), 1.0)),
                "mean_ttft_ms": _r(m.ttft_ms.mean, 1),
                "p99_ttft_ms": _r(m.ttft_ms.percentiles["p99"], 1),
                "mean_tpot_ms": _r(m.tpot_ms.mean, 2),
                "output_tok_s": _r(m.output_throughput, 1),
                "deploy_s": _r(app.deploy_s, 1),
            }
        finally:
            cluster.delete(app)
    hp = results["hybrid_prefix"]["cached_fraction"]
    return {
        "routing_hit_ratio_vs_round_robin": _ratio(hp, results["round_robin"]["cached_fraction"]),
        "routing_hit_ratio_vs_ray": _ratio(hp, results["ray_prefix"]["cached_fraction"]),
        "routing_load_max_min": results["hybrid_prefix"]["load_max_min"],
        "routers": results,
        "num_replicas": c.num_replicas,
        "workload": {**w.info, "measured_requests": len(w.sessions), "warmup_requests": len(w.warmup)},
        "replica_cache_tokens": per_replica_cache,
        "rate": c.rate,
        "max_concurrency": c.max_concurrency,
    }


def _ratio(a: float, b: float) -> float | None:
    return _r(a / b) if b > 0 else None


# -- simulation -------------------------------------------------------------------------------------
def simulation(cfg: SuiteConfig) -> dict[str, Any]:
    from cluster.bench.routing_sim import PROPOSED, SimSettings, format_table, run_grid

    engine = HybridServeConfig.model_validate({**cfg.routing.engine, "model": cfg.routing.model})
    settings = SimSettings(
        cache_tokens=engine.cache.max_kv_tokens or 32768,
        page_size=engine.cache.page_size,
        track_interval=engine.cache.mamba_track_interval,
        chunk_size=engine.scheduler.chunked_prefill_size,
    )
    routers = ("hybrid_prefix", "ray_prefix", "round_robin") + PROPOSED
    overrides = {w: cfg.routing.overrides for w in cfg.simulation.workloads if w == cfg.routing.workload}
    results = run_grid(cfg.simulation.workloads, cfg.simulation.replicas, routers, settings, overrides)
    # The same cache-pressure replay with the schema's default chunk and checkpoint grid
    # (512 / 256): contexts shorter than a chunk get no checkpoint of their own.
    default = HybridServeConfig()
    plain = replace(
        settings, track_interval=default.cache.mamba_track_interval, chunk_size=default.scheduler.chunked_prefill_size
    )
    defaults = run_grid([cfg.routing.workload], cfg.simulation.replicas, routers, plain, overrides)
    return {
        "table": format_table(results),
        "settings": asdict(settings),
        "results": [asdict(r) for r in results],
        "default_engine_table": format_table(defaults),
        "default_engine_settings": asdict(plain),
        "default_engine_results": [asdict(r) for r in defaults],
    }


def tiers(cfg: SuiteConfig, model: Path) -> dict[str, Any]:
    """The tiers: slot_pressure, tiers on vs device only and our router vs Ray's rule, on
    in-process replicas (bench/tiers.py); the 20-conversation multi-turn case. The three
    goals are read at one operating point, below capacity (``ClusterSettings.below_capacity``
    says why: overloaded, TTFT is the queue's length under any cache); the overloaded
    defaults are reported beside them."""
    from dataclasses import asdict

    from cluster.bench import tiers as T
    from cluster.bench.workloads import load_workload

    t = cfg.tiers
    sessions = load_workload("slot_pressure", {"num_sessions": t.num_sessions, "num_turns": t.num_turns}).sessions
    overloaded = T.ClusterSettings(num_replicas=t.num_replicas, host_factor=t.host_factor)
    settings = overloaded.below_capacity()

    def point(s: T.ClusterSettings) -> dict[str, Any]:
        results = [T.run_one(model, sessions, router, on, s) for router in t.routers for on in (False, True)]
        return {
            "results": [asdict(r) for r in results],
            "goals": T.goals(results),
            "settings": asdict(s),
            "table": T.format_table(results),
            "explain_table": T.format_explanation([(r.router, r.tiers, r.explain) for r in results]),
            "split_table": T.format_split([(r.router, r.tiers, r.split) for r in results], T.StepCost()),
        }

    multi = {
        ("host" if host else "device"): T.multi_turn_case(model, "extra_buffer_lazy", host) for host in (False, True)
    }
    return {**point(settings), "multi_turn": multi, "overloaded": point(overloaded)}
