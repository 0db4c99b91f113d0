"""Where the HTTP path's time per token goes: one decode workload measured at each layer
of the serving path, and the CPU every process of a real Ray Serve cluster spends on it.

    python -m tests.lab.http_hops [--batch 8 --prompt-len 32 --output-len 64 --repeats 2]
        [--stream-interval-s 0.05 --stream-items-per-s 100] [--model DIR] [--no-serve | --serve-only]
        [--eager] [--out hops.json]

In one process, no Ray, each layer on top of the one before (best of ``repeats``
interleaved runs; decode tok/s = batch / mean TPOT, TPOT = (last - first token) / (n - 1)):

1. ``bare``: the model's forward on pre-built decode batches (``inproc.bare_decode_rate``);
2. ``engine``: + scheduler, sampler, detokenization, outputs (``Engine.step`` in a loop);
3. ``replica``: + ``EngineLoop`` (engine thread <-> event loop) and ``ReplicaCore``'s
   chunks and stream batching, read by asyncio tasks;
4. ``ingress``: + ``OpenAIServer``: validation, SamplingParams, ``ResponseState`` and SSE
   framing, read as event strings; ``client_parse`` is the CPU the bench client's parse
   (``client.sse_payload``, ``choice_content``; not httpx's line splitting) spends on them.

Through Ray Serve (``LocalCluster``, the suite's replica options), HTTP -> proxy -> ingress
-> replica with the bench client (``cluster.bench.client``): the rate as above, and the CPU
ms per output token of each process of the cluster (``proc_cpu``: the replica, the ingress,
the proxy, the client (this process), Serve's controller, Ray's own processes) and of
their busiest threads, and the engine's step and idle times (``/debug/replicas`` ``loop``).

Every engine (bare, in-process layers, the replica) compiles its decode step for one bucket
of ``--batch`` as the suite's engines do (``suite_config.CompileCfg``); ``--eager`` runs
them uncompiled.

A hop's cost is its layer's us per token minus the layer's below. On a shared 2-core
machine every figure is an indication: the load average is reported with them. Latency
rather than cost per token (one request's TTFT, one stream's rate): ``http_latency``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from cluster.bench import inproc
from cluster.bench.proc_cpu import cpu_delta, ms_per_unit_by_role, role, snapshot

LAYERS = ("bare", "engine", "replica", "ingress")  # in process, each on the one before
EXTRA = ("client_parse_us", "replica_gap_us", "ingress_gap_us")  # us per output token


def pacing(args: argparse.Namespace) -> Any:
    """The replicas' ``StreamPacing``: the config's ``replica`` defaults but for the flags given."""
    from cluster.serving.replica_core import StreamPacing
    from configs.serving import ReplicaConfig

    given = {"stream_interval_s": args.stream_interval_s}
    if args.stream_items_per_s is not None:
        given["stream_items_per_s"] = args.stream_items_per_s
    opts = ReplicaConfig(**given)
    return StreamPacing(opts.stream_interval_s, opts.stream_items_per_s, opts.max_stream_interval_s)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engines' overrides: the suite's CPU settings and compile bucket, 16k KV tokens."""
    from cluster.bench.suite_config import CompileCfg

    return {**inproc.engine_kwargs(CompileCfg(enabled=not args.eager), args.batch), "cache": {"max_kv_tokens": 16384}}


def _prompts(seed: int, batch: int, prompt_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, 500) for _ in range(prompt_len)] for _ in range(batch)]


def _rate(tpots: list[float]) -> float:
    return len(tpots) / (sum(tpots) / len(tpots))


async def replica_rate(core: Any, prompts: list[list[int]], out_len: int) -> float:
    """Decode tok/s of ``prompts`` streamed through ``ReplicaCore.generate`` together."""
    from cluster.serving.messages import GenerateRequest

    async def one(i: int, prompt: list[int]) -> float:
        req = GenerateRequest(f"hops-{uuid.uuid4().hex}-{i}", prompt, [inproc.greedy(out_len)])
        first = last = 0.0
        num = 0
        async for item in core.generate(req):
            got = sum(len(c.new_token_ids) for c in item) if isinstance(item, list) else 0
            if got:
                last = time.perf_counter()
                first = first or last
                num += got
        return (last - first) / (num - 1)

    return _rate(list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))))


async def ingress_rate(server: Any, prompts: list[list[int]], out_len: int) -> tuple[float, list[str]]:
    """Decode tok/s through ``OpenAIServer`` (streamed completions), and every SSE event."""
    events: list[str] = []

    async def one(prompt: list[int]) -> float:
        body = {
            "model": server.settings.model_name,
            "prompt": prompt,
            "max_tokens": out_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = await server.start_completion(json.dumps(body).encode())
        first = 0.0
        async for event in server.events(started):
            first = first or time.perf_counter()
            events.append(event)
        return (time.perf_counter() - first) / (out_len - 1)

    tpots = list(await asyncio.gather(*(one(p) for p in prompts)))
    return _rate(tpots), events


def client_parse_s(events: list[str]) -> float:
    """CPU seconds the bench client's per-line parse takes over ``events``."""
    from cluster.bench.client import choice_content, sse_payload

    start = time.process_time()
    for line in "".join(events).splitlines():
        obj = sse_payload(line)
        if isinstance(obj, dict):
            for choice in obj.get("choices") or []:
                choice_content("completions", choice)
    return time.process_time() - start


async def in_process(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every in-process layer, interleaved ``repeats`` times: best tok/s per layer."""
    from cluster.api.openai_server import OpenAIServer, ServerSettings
    from cluster.serving.engine_client import LocalEngineClient
    from cluster.serving.replica_core import ReplicaCore
    from configs.schema import load_config
    from workers.llm import LLM

    engine_cfg = engine_settings(args)
    bare_llm, engine_llm = (LLM(model=str(model), **engine_cfg) for _ in range(2))
    config = load_config(overrides={**engine_cfg, "model": str(model)})
    core = await ReplicaCore.create(config, pacing(args))
    server = OpenAIServer(
        LocalEngineClient(core, "hops"), core.loop.engine.tokenizer, ServerSettings.from_config(config, "hops")
    )
    samples: dict[str, list[float]] = {name: [] for name in (*LAYERS, *EXTRA)}
    tokens = args.batch * args.output_len
    try:
        for r in range(args.repeats):
            prompts = _prompts(100 + r, args.batch, args.prompt_len)
            samples["bare"].append(inproc.bare_decode_rate(bare_llm, prompts, args.output_len))
            records, _ = inproc.engine_records(engine_llm, prompts, args.output_len)
            samples["engine"].append(_rate([rec.tpot or 0.0 for rec in records]))
            t0 = core.loop.times
            prompts = _prompts(1000 + r, args.batch, args.prompt_len)
            samples["replica"].append(await replica_rate(core, prompts, args.output_len))
            t1 = core.loop.times
            rate, events = await ingress_rate(server, _prompts(2000 + r, args.batch, args.prompt_len), args.output_len)
            samples["ingress"].append(rate)
            t2 = core.loop.times
            for name, a, b in (("replica_gap_us", t0, t1), ("ingress_gap_us", t1, t2)):
                samples[name].append(1e6 * (b.step_gap_s - a.step_gap_s) / tokens)
            samples["client_parse_us"].append(1e6 * client_parse_s(events) / tokens)
    finally:
        await core.shutdown()
    best = {name: max(samples[name]) for name in LAYERS}
    best.update({name: min(samples[name]) for name in EXTRA})
    return {"tok_s": best, "samples": samples}


def _replica_stats(base_url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(f"{base_url}/debug/replicas", timeout=30.0, trust_env=False).json()["replicas"][0]


def _serve_run(app: Any, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One measured HTTP run: its rate and the CPU each process spent per output token."""
    from cluster.bench.client import LoadSettings
    from cluster.bench.suite_sections import _bench
    from cluster.bench.workloads import RandomSpec, build

    w = build(
        RandomSpec(
            num_prompts=args.batch, input_len=args.prompt_len, output_len=args.output_len, range_ratio=0.0, seed=seed
        )
    )
    rep0 = _replica_stats(app.base_url)
    before = snapshot()
    res = _bench(app, w, LoadSettings(max_concurrency=args.batch))
    after = snapshot()
    rep1 = _replica_stats(app.base_url)
    tokens = sum(r.output_tokens for r in res.records)
    threads: dict[str, list[tuple[str, float]]] = {}
    pids = {"client": {os.getpid()}, "replica": {int(rep1["pid"])} if rep1.get("pid") else set()}
    delta = cpu_delta(before, after)
    for pid, proc in delta.items():
        if (name := role(proc.name, pids, pid)) in ("replica", "ingress", "proxy"):
            top = sorted(proc.threads.values(), key=lambda t: -t[1])[:4]
            threads[name] = [(comm, round(1e3 * s / tokens, 3)) for comm, s in top if s > 0]
    # a replica without loop times
    zero = {"num_steps": 0, "step_wall_s": 0.0, "step_cpu_s": 0.0, "step_gap_s": 0.0}
    loop = {k: rep1.get("loop", zero)[k] - rep0.get("loop", zero)[k] for k in zero}
    cpu_ms = ms_per_unit_by_role(delta, tokens, pids)
    paths = [rep.get("counters", {}).get("hybridserve_engine_steps_total", {}) for rep in (rep0, rep1)]
    return {
        "steps_by_path": {p: paths[1].get(p, 0) - paths[0].get(p, 0) for p in ("compiled", "eager")},
        "tok_s": args.batch / (res.metrics.tpot_ms.mean / 1000),
        "tokens": tokens,
        "itl_ms_median": round(res.metrics.itl_ms.median, 1),
        "items_per_request": round(sum(len(r.itl) + 1 for r in res.records) / len(res.records), 1),
        "cpu_ms_per_token": cpu_ms,
        "top_threads_ms_per_token": threads,
        "engine_step_wall_us_per_token": round(1e6 * loop["step_wall_s"] / tokens, 1),
        "engine_step_cpu_us_per_token": round(1e6 * loop["step_cpu_s"] / tokens, 1),
        "engine_gap_us_per_token": round(1e6 * loop["step_gap_s"] / tokens, 1),
        "num_steps": loop["num_steps"],
    }


def through_serve(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from cluster.bench.serving import LocalCluster
    from cluster.bench.suite_sections import REPLICA, _warm

    engine = {**engine_settings(args), "model": str(model)}
    p = pacing(args)
    with LocalCluster() as cluster:
        app = cluster.deploy(
            "hops",
            engine,
            "hybrid_prefix",
            {**REPLICA, "stream_interval_s": p.interval_s, "stream_items_per_s": p.items_per_s},
        )
        try:
            _warm(app)
            runs = [_serve_run(app, args, 200 + r) for r in range(args.repeats)]
        finally:
            cluster.delete(app)
    best = max(runs, key=lambda run: run["tok_s"])
    return {**best, "samples_tok_s": [round(run["tok_s"], 1) for run in runs]}


def report(result: dict[str, Any]) -> str:
    """The per-hop table: us per token of each layer and what it adds to the one below."""
    best = result.get("in_process", {}).get("tok_s", {})
    rates = {name: best[name] for name in LAYERS if name in best}
    if "serve" in result:
        rates["http (Ray Serve)"] = result["serve"]["tok_s"]
    lines = [f"{'layer':<18}{'tok/s':>9}{'us/token':>10}{'hop us':>9}", "-" * 46]
    prev = None
    for name, rate in rates.items():
        us = 1e6 / rate
        lines.append(f"{name:<18}{rate:>9.1f}{us:>10.0f}{'' if prev is None else f'{us - prev:+9.0f}'}")
        prev = us
    if best:
        lines.append(
            f"client parse (CPU): {best['client_parse_us']:.1f} us/token; engine idle between steps "
            f"(in process): replica {best['replica_gap_us']:.1f}, "
            f"ingress {best['ingress_gap_us']:.1f} us/token"
        )
    if "serve" in result:
        s = result["serve"]
        lines.append(
            f"stream items per request {s['items_per_request']}, "
            f"ITL median {s['itl_ms_median']} ms; replica steps by path {s['steps_by_path']}"
        )
        lines.append(
            f"engine steps in the replica: {s['engine_step_wall_us_per_token']} us/token wall, "
            f"{s['engine_step_cpu_us_per_token']} us/token CPU of the stepping thread "
            f"(with overlap the forward runs on another), idle between steps "
            f"{s['engine_gap_us_per_token']} us/token ({s['num_steps']} steps)"
        )
        lines.append(
            "CPU ms per output token by process: " + ", ".join(f"{k} {v}" for k, v in s["cpu_ms_per_token"].items())
        )
        for name, top in s["top_threads_ms_per_token"].items():
            lines.append(f"  {name} threads: " + ", ".join(f"{c} {v}" for c, v in top))
    lines.append(f"load average: start {result['loadavg_start']}, end {result['loadavg_end']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stream-interval-s", type=float, default=0.05, help="the replicas' stream batching")
    ap.add_argument(
        "--stream-items-per-s",
        type=float,
        default=None,
        help="the replicas' item budget, all streams together (default: the config's; 0: none)",
    )
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the suite's bench model)")
    ap.add_argument("--no-serve", action="store_true", help="only the in-process layers (no Ray)")
    ap.add_argument("--serve-only", action="store_true", help="only the Ray Serve path")
    ap.add_argument("--eager", action="store_true", help="no compiled steps (default: the suite's bucket)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.output_len < 3 or args.repeats < 1:
        raise SystemExit(
            f"need batch >= 1, output-len >= 3, repeats >= 1; got {args.batch}, {args.output_len}, {args.repeats}"
        )
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any] = {"args": vars(args), "loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else inproc.make_bench_model(Path(tmp) / "bench-15m")
        if not args.serve_only:
            result["in_process"] = asyncio.run(in_process(model, args))
        if not args.no_serve:
            result["serve"] = through_serve(model, args)
    result["loadavg_end"] = os.getloadavg()
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
