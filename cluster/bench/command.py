"""``hybridserve bench``: arguments and the modes.

    hybridserve bench --url http://127.0.0.1:8000 --workload shared_prefix \
        [--rate 4 --burstiness 1 --max-concurrency 8 --num-prompts 64 --seed 0 \
         --goodput ttft:2000 tpot:250 --set output_len=16 --out result.json]
    hybridserve bench suite --out DIR [--config SUITE.yaml] [--set key=value ...]
    hybridserve bench host-overhead [--batch 1 8 32 128 256 512] [--modes default mtp] \
        [--steps 30 --warmup 5 --json --out result.json]
    hybridserve bench correctness --url URL --reference-url URL [--concurrency 8 --requests 200 \
        --near-tie --json --out result.json]
    hybridserve bench pd [--streams 6 --stream-tokens 600 --long-prompts 8 --eager --json]

``--set`` overrides fields of the workload (run mode) or of the suite config (suite mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from cluster.bench.correctness import add_args as add_correctness_args
from cluster.bench.host_overhead import add_args as add_host_overhead_args
from cluster.bench.pd import add_args as add_pd_args
from configs.schema import parse_set_items


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "mode",
        nargs="?",
        choices=("suite", "host-overhead", "correctness", "pd"),
        default=None,
        help="'suite': run the comparison suite (starts its own local cluster); "
        "'host-overhead': the engine's host CPU per request and step, in process; "
        "'correctness': every greedy output of --url against --reference-url's; "
        "'pd': prefill/decode disaggregation against colocated replicas (starts its own local cluster)",
    )
    p.add_argument("--url", default=None, help="server base URL (with or without /v1)")
    p.add_argument("--workload", default="random", help="a name in configs/workloads or a YAML path")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--rate", type=float, default=math.inf, help="sessions per second (default: inf)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N sessions")
    p.add_argument("--seed", type=int, default=None, help="workload and arrival seed")
    p.add_argument(
        "--goodput",
        nargs="*",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:2000 tpot:250 e2el:10000",
    )
    p.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir for text prompts (default: the server's model root if local)"
    )
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--config", type=Path, default=None, help="suite mode: suite YAML")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a workload field (or, in suite mode, a suite field)",
    )
    p.add_argument("--out", default=None, help="run mode: JSON result file; suite mode: output dir")
    add_host_overhead_args(
        p.add_argument_group(
            "host-overhead mode (--model: a checkpoint dir instead of the null model; --seed: the prompts')"
        )
    )
    add_correctness_args(p.add_argument_group("correctness mode (--url: the server under test)"))
    add_pd_args(p.add_argument_group("pd mode"))


def run(args: argparse.Namespace) -> int:
    if args.mode == "suite":
        from cluster.bench.suite import run_suite

        if not args.out:
            raise ValueError("bench suite needs --out DIR")
        return run_suite(Path(args.out), args.config, parse_set_items(args.overrides))
    if args.mode == "host-overhead":
        from cluster.bench import host_overhead

        return host_overhead.run(args)
    if args.mode == "correctness":
        from cluster.bench import correctness

        return correctness.run(args)
    if args.mode == "pd":
        from cluster.bench import pd

        return pd.run_command(args)
    if not args.url:
        raise ValueError("bench needs --url (or the 'suite' or 'host-overhead' mode)")
    return _run_once(args)


def _run_once(args: argparse.Namespace) -> int:
    from cluster.bench.client import LoadSettings, Target, run_benchmark
    from cluster.bench.metrics import format_report, parse_slos
    from cluster.bench.workloads import Renderer, build, load_spec, workload_path

    overrides: dict[str, Any] = parse_set_items(args.overrides)
    if args.seed is not None:
        overrides["seed"] = args.seed
    spec = load_spec(args.workload, overrides)
    if args.num_prompts is not None and "num_prompts" in type(spec).model_fields:
        spec = spec.model_copy(update={"num_prompts": args.num_prompts})
    workload = build(spec, workload_path(args.workload).stem)
    if args.num_prompts is not None:
        workload = replace(workload, sessions=workload.sessions[: args.num_prompts])
    target = Target(args.url, args.model, args.api_key, ignore_eos=not args.no_ignore_eos)
    renderer = Renderer()
    if workload.prompt_format == "text":
        renderer = Renderer.from_path(args.tokenizer or _local_root(target))
    load = LoadSettings(
        rate=args.rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=spec.seed,
        slos_ms=parse_slos(args.goodput),
        percentiles=tuple(float(p) for p in args.percentiles.split(",") if p),
    )
    result = asyncio.run(run_benchmark(target, workload, load, renderer))
    print(format_report(result.metrics, f"{workload.name} @ {result.model}"))
    failures = [r.error for r in result.records if not r.success]
    if failures:
        print(f"first failure: {failures[0]}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "workload": workload.name,
                    "spec": spec.model_dump(),
                    "model": result.model,
                    "rate": args.rate,
                    "burstiness": args.burstiness,
                    "max_concurrency": args.max_concurrency,
                    "metrics": result.metrics.to_dict(),
                },
                indent=2,
            )
        )
    return 0 if result.metrics.completed else 1


def _local_root(target: Any) -> str | None:
    """The server's ``root`` from /v1/models when it names a local model dir (vLLM's habit)."""
    from cluster.bench.client import resolve_model

    try:
        root = resolve_model(target).get("root")
    except Exception:  # noqa: BLE001 - no root: render with words
        return None
    if root and (Path(root) / "tokenizer_config.json").exists():
        return str(root)
    from configs.schema import HybridServeConfig

    if root:  # a repo-relative model path (ours reports config.model)
        resolved = HybridServeConfig(model=root).model_dir()
        if (resolved / "tokenizer_config.json").exists():
            return str(resolved)
    return None
