"""``hybridserve bench suite --out DIR``: the issue-7 comparisons, one table, ``DIR/summary.json``.

Order: the in-process comparisons (overlap, speculation, run-batch vs transformers, the
~100M model's EOS workload, start-up time with compilation: ``suite_compiled``, the host
overhead of a step: ``host_overhead``), then
one local Ray Serve cluster for the HTTP ones (decode efficiency and prefix cache on one
replica; three routers over ``routing.num_replicas`` replicas), then the routing
simulator, then the checkpoint tiers (``bench/tiers.py``, in process). A section that fails
is reported with its error and the others still run.

``summary.json`` holds the headline keys (``serving_efficiency``, ``vs_transformers_speedup``,
``prefix_cache_prefill_fraction``, ``prefix_cache_ttft_ratio``,
``routing_hit_ratio_vs_round_robin``, ``routing_hit_ratio_vs_ray``,
``routing_load_max_min``, ``spec_tpot_speedup``, ``overlap_speedup``, ``eos_workload_speedup``,
``startup_cold_s``, ``startup_warm_s``, the host overhead (``host_us_per_step_1``,
``host_us_per_request_step_128`` / ``_256``, ``mtp_verified_per_request_step_32``,
``mtp_overlapped_fraction_32``), and the tiers' ``tiers_prefill_ratio``,
``tiers_ttft_ratio``, ``tiers_cached_vs_ray``, ``multi_turn_turn2_hits``), ``goals`` (bound
and met per key), ``details`` (every section's measurements and samples), ``machine``
and ``config``. The same table is written to ``DIR/table.md``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.bench.suite_config import GOALS, SuiteConfig, load_suite_config

HEADLINE = {  # summary key -> (section, path inside its result)
    "serving_efficiency": ("serving", ("efficiency", "serving_efficiency")),
    "vs_transformers_speedup": ("vs_transformers", ("vs_transformers_speedup",)),
    "prefix_cache_prefill_fraction": ("serving", ("prefix_cache", "prefix_cache_prefill_fraction")),
    "prefix_cache_ttft_ratio": ("serving", ("prefix_cache", "prefix_cache_ttft_ratio")),
    "routing_hit_ratio_vs_round_robin": ("routing", ("routing_hit_ratio_vs_round_robin",)),
    "routing_hit_ratio_vs_ray": ("routing", ("routing_hit_ratio_vs_ray",)),
    "routing_load_max_min": ("routing", ("routing_load_max_min",)),
    "spec_tpot_speedup": ("spec", ("spec_tpot_speedup",)),
    "overlap_speedup": ("overlap", ("overlap_speedup",)),
    "tiers_prefill_ratio": ("tiers", ("goals", "computed_prefill_tiers_over_device")),
    "tiers_ttft_ratio": ("tiers", ("goals", "ttft_model_s_tiers_over_device")),
    "tiers_cached_vs_ray": ("tiers", ("goals", "cached_vs_ray")),
    "multi_turn_turn2_hits": ("tiers", ("multi_turn", "host", "turn2_hits")),
    "eos_workload_speedup": ("eos_workload", ("eos_workload_speedup",)),
    "startup_cold_s": ("startup", ("startup_cold_s",)),
    "startup_warm_s": ("startup", ("startup_warm_s",)),
    "host_us_per_step_1": ("host_overhead", ("goals", "host_us_per_step_1")),
    "host_us_per_request_step_128": ("host_overhead", ("host_us_per_request_step", "128")),
    "host_us_per_request_step_256": ("host_overhead", ("host_us_per_request_step", "256")),
    "mtp_verified_per_request_step_32": ("host_overhead", ("goals", "mtp_verified_per_request_step_32")),
    "mtp_overlapped_fraction_32": ("host_overhead", ("goals", "mtp_overlapped_fraction_32")),
}


def machine_info() -> dict[str, Any]:
    def first(path: str, key: str) -> str:
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return "?"

    import ray
    import torch

    return {
        "cpu": first("/proc/cpuinfo", "model name"),
        "cpu_count": os.cpu_count(),
        "memory": first("/proc/meminfo", "MemTotal"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg(),
    }


def run_suite(out_dir: Path, config_path: Path | None = None, overrides: dict[str, Any] | None = None) -> int:
    import torch

    from cluster.bench import inproc
    from cluster.bench import suite_compiled as C
    from cluster.bench import suite_sections as S

    cfg = load_suite_config(config_path, overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # like a replica (Ray gives a 1-CPU actor one OMP thread)
    inproc.quiet_transformers()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    start = time.perf_counter()
    machine = machine_info()
    details: dict[str, Any] = {}
    timings: dict[str, float] = {}
    model = Path(cfg.bench_model) if cfg.bench_model else inproc.make_bench_model(out_dir / "models" / "bench-15m")

    def section(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if name not in cfg.sections:
            return
        t0 = time.perf_counter()
        print(f"[suite] {name} ...", flush=True)
        try:
            details[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the rest
            details[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(f"[suite] {name} failed: {exc!r}", flush=True)
        timings[name] = round(time.perf_counter() - t0, 1)
        print(f"[suite] {name} done in {timings[name]} s", flush=True)

    section("overlap", lambda: S.overlap(cfg, model))
    section("spec", lambda: S.spec(cfg))
    section("vs_transformers", lambda: S.vs_transformers(cfg, model))
    section("eos_workload", lambda: C.eos_workload(cfg, out_dir))
    section("startup", lambda: C.startup(cfg, model, out_dir))
    section("host_overhead", lambda: S.host_overhead(cfg))
    if {"serving", "routing"} & set(cfg.sections):
        from cluster.bench.serving import LocalCluster

        with LocalCluster() as cluster:
            section("serving", lambda: S.serving(cfg, cluster, model))
            section("routing", lambda: S.routing(cfg, cluster))
    section("simulation", lambda: S.simulation(cfg))
    section("tiers", lambda: S.tiers(cfg, model))
    machine["loadavg_end"] = os.getloadavg()
    summary = build_summary(details, cfg, machine, timings, time.perf_counter() - start)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    table = format_table(summary)
    (out_dir / "table.md").write_text(table + "\n")
    print(table)
    print(f"[suite] wrote {out_dir / 'summary.json'} in {summary['wall_s']} s")
    return 0 if not any("error" in d for d in details.values()) else 1


def _dig(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def build_summary(
    details: dict[str, Any], cfg: SuiteConfig, machine: dict[str, Any], timings: dict[str, float], wall_s: float
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    goals = {}
    for key, (section, path) in HEADLINE.items():
        value = _dig(details.get(section), path)
        summary[key] = value
        goal = GOALS[key]
        goals[key] = {"goal": goal.text(), "met": goal.met(value), "what": goal.what}
    summary.update(
        goals=goals,
        notes=notes(details),
        details=details,
        machine=machine,
        section_seconds=timings,
        wall_s=round(wall_s, 1),
        config=cfg.model_dump(),
    )
    return summary


def notes(d: dict[str, Any]) -> dict[str, str]:
    """One line per headline key: what was measured on what (the table's last column)."""
    out: dict[str, str] = {}
    for name, sec in d.items():
        if "error" in sec:
            out[name] = f"section failed: {sec['error']}"
    if e := _dig(d, ("serving", "efficiency")):
        out["serving_efficiency"] = (
            f"HTTP {e['http_decode_tok_s']} vs bare {e['bare_decode_tok_s']} tok/s "
            f"(engine in-process {e['engine_decode_tok_s']}), batch {e['batch']}"
        )
    if (t := d.get("vs_transformers")) and "error" not in t:
        out["vs_transformers_speedup"] = (
            f"{t['run_batch_tok_s']} vs {t['hf_batched_tok_s']} tok/s "
            f"(HF one padded batch); HF one prompt at a time: "
            f"{t['vs_transformers_sequential_speedup']}x"
        )
    if p := _dig(d, ("serving", "prefix_cache")):
        out["prefix_cache_prefill_fraction"] = (
            f"{p['cached_tokens']['on']} of {p['prompt_tokens']['on']} "
            f"prompt tokens cached, {p['num_requests']} requests"
        )
        out["prefix_cache_ttft_ratio"] = (
            f"{p['mean_ttft_ms']['on']} vs {p['mean_ttft_ms']['off']} ms; "
            f"a {p['floor_prompt_len']}-token prompt takes "
            f"{p['ttft_floor_ms']} ms"
        )
    if (r := d.get("routing")) and "error" not in r:
        fr = {k: v["cached_fraction"] for k, v in r["routers"].items()}
        out["routing_hit_ratio_vs_round_robin"] = (
            f"cached {fr['hybrid_prefix']} vs {fr['round_robin']}, {r['num_replicas']} replicas"
        )
        out["routing_hit_ratio_vs_ray"] = f"cached {fr['hybrid_prefix']} vs {fr['ray_prefix']}"
        out["routing_load_max_min"] = "requests " + " / ".join(
            str(int(v)) for v in r["routers"]["hybrid_prefix"]["requests_per_replica"].values()
        )
    if (s := d.get("spec")) and "error" not in s:
        which = "trained default" if s["trained_model"] else "FALLBACK tiny-hybrid (trained model absent)"
        out["spec_tpot_speedup"] = (
            f"{which}, k={s['num_draft_tokens']}, acceptance "
            f"{s['acceptance_by_k'][s['num_draft_tokens']]}; "
            f"by k: {s['speedup_by_k']}"
        )
    if (o := d.get("overlap")) and "error" not in o:
        out["overlap_speedup"] = f"{o['tok_s_on']} vs {o['tok_s_off']} tok/s"
    if (t := d.get("tiers")) and "error" not in t:
        out.update(_tiers_notes(t))
    if (e := d.get("eos_workload")) and "error" not in e:
        out["eos_workload_speedup"] = (
            f"{e['engine_tok_s']} vs {e['hf_tok_s']} tok/s, "
            f"{e['num_parameters'] / 1e6:.0f}M "
            f"parameters, {len(e['output_lens'])} requests, batch {e['batch']}"
        )
    if (h := d.get("host_overhead")) and "error" not in h:
        out.update(_host_notes(h))
    if (s := d.get("startup")) and "error" not in s:
        out["startup_cold_s"] = f"eager start-up {s['startup_eager_s']} s; batch sizes {s['batch_sizes']}"
        out["startup_warm_s"] = "the same, over the cache the cold run filled" + _cache_note(s.get("cache_warm"))
    return out


def _tiers_notes(t: dict[str, Any]) -> dict[str, str]:
    """The tiers rows' last column: below capacity against device-only, the overloaded point."""
    out: dict[str, str] = {}
    r = {(x["router"], x["tiers"]): x for x in t["results"]}
    on, off = r.get(("hybrid_prefix", True)), r.get(("hybrid_prefix", False))
    over = {(x["router"], x["tiers"]): x for x in t["overloaded"]["results"]}
    oon, ooff = over.get(("hybrid_prefix", True)), over.get(("hybrid_prefix", False))
    og = t["overloaded"]["goals"]
    if on and off:
        point = f"below capacity, host tier {t['settings']['host_factor']} device budgets"
        out["tiers_prefill_ratio"] = (
            f"{point}: computed {on['computed_fraction']} vs "
            f"{off['computed_fraction']}; "
            f"overloaded {og['computed_prefill_tiers_over_device']}"
        )
        lon, loff = on["split"], off["split"]
        out["tiers_ttft_ratio"] = (
            f"{point}: modelled {lon['ttft_model_s']} vs {loff['ttft_model_s']} s (queue "
            f"{lon['queue_model_s']} vs {loff['queue_model_s']}), "
            f"{lon['ttft_steps']} vs {loff['ttft_steps']} steps; "
            f"overloaded {og['ttft_model_s_tiers_over_device']}"
            + (f" ({oon['split']['ttft_model_s']} vs {ooff['split']['ttft_model_s']} s)" if oon and ooff else "")
        )
    if on and (ray := r.get(("ray_prefix", True))):
        oracle = on.get("explain", {}).get("oracle_cached_fraction")
        out["tiers_cached_vs_ray"] = (
            f"cached {on['cached_fraction']} vs {ray['cached_fraction']}; "
            f"oracle {oracle}; overloaded {og['cached_vs_ray']}"
        )
    m = t["multi_turn"]
    out["multi_turn_turn2_hits"] = f"host tier on {m['host']['turn2_hits']}/20, off {m['device']['turn2_hits']}/20"
    return out


def _host_notes(h: dict[str, Any]) -> dict[str, str]:
    """The host-overhead rows' last column: the per-request figure over every batch size."""
    per = " / ".join(f"{v}" for v in h["host_us_per_request_step"].values())
    batches = "/".join(h["host_us_per_request_step"])
    out = {
        "host_us_per_step_1": f"us per request-step at batch {batches}: {per}",
        "host_us_per_request_step_128": f"load {h['loadavg_start'][0]:.1f}-{h['loadavg_end'][0]:.1f}",
    }
    if m := h.get("mtp"):
        out["host_us_per_request_step_256"] = "MTP k=3: " + " / ".join(
            f"{v}" for v in m["host_us_per_request_step"].values()
        )
        out["mtp_verified_per_request_step_32"] = f"by batch {m['verified_per_request_step']}"
        out["mtp_overlapped_fraction_32"] = f"by batch {m['overlapped_fraction']}"
    return out


def _cache_note(cache: dict[str, int] | None) -> str:
    """What the warm start-up's FX-graph cache did (frozen graphs are refused: bypasses)."""
    if not cache:
        return ""
    return (
        f" (FX-graph cache: {cache['fxgraph_cache_hit']} hits, {cache['fxgraph_cache_miss']} misses, "
        f"{cache['fxgraph_cache_bypass']} refused)"
    )


def format_table(summary: dict[str, Any]) -> str:
    lines = ["| metric | value | goal | met | measured |", "|---|---|---|---|---|"]
    for key in HEADLINE:
        g = summary["goals"][key]
        value = summary[key]
        met = {True: "yes", False: "**no**", None: "n/a"}[g["met"]]
        lines.append(
            f"| {key} | {'—' if value is None else value} | {g['goal']} | {met} | {summary['notes'].get(key, '')} |"
        )
    sim = _dig(summary, ("details", "simulation"))
    if sim and "table" in sim:
        st, dt = sim["settings"], sim["default_engine_settings"]
        lines += [
            "",
            f"Routing simulator (real index and routers, modelled replicas; chunk {st['chunk_size']}, "
            f"checkpoint grid {st['track_interval']}, {st['cache_tokens']} cache tokens per replica):",
            "",
            "```",
            sim["table"],
            "```",
            "",
            f"Same cache-pressure replay with the default chunk {dt['chunk_size']} and grid {dt['track_interval']}:",
            "",
            "```",
            sim["default_engine_table"],
            "```",
        ]
    tiers = _dig(summary, ("details", "tiers"))
    if tiers and "table" in tiers:
        lines += [
            "",
            "Checkpoint tiers, slot_pressure over in-process replicas (bench/tiers.py), below "
            "capacity (the goals' point):",
            "",
            "```",
            tiers["table"],
            "",
            tiers.get("split_table", ""),
            "",
            tiers.get("explain_table", ""),
            "```",
        ]
        if (over := tiers.get("overloaded")) and "table" in over:
            lines += [
                "",
                "The same, overloaded (the workload's defaults):",
                "",
                "```",
                over["table"],
                "",
                over.get("split_table", ""),
                "```",
            ]
    return "\n".join(lines)
