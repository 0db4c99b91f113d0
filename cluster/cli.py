"""The ``hybridserve`` command: ``serve`` (local Ray cluster + the app), ``run-batch``,
``bench`` (the load client; ``bench suite`` runs the comparison suite).

Every command takes ``--config FILE.yaml`` and repeatable ``--set key=value`` overrides
with dotted config names (``--set cache.mamba_track_interval=16``; docs/configuration.md).
``serve`` also reads as ``vllm serve`` does: the model directory as its argument and
vLLM's flags for the common settings (``VLLM_FLAGS``), each the same as a ``--set`` of
its config key; a flag and a ``--set`` of one key must agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from configs.reference import setting
from configs.schema import HybridServeConfig, combine_overrides, load_config, parse_set_items


class VllmFlag(NamedTuple):
    flag: str  # as vLLM spells it
    key: str  # the dotted config key it sets
    type: type


VLLM_FLAGS = (
    VllmFlag("--tensor-parallel-size", "parallel.tensor_parallel_size", int),
    VllmFlag("--host", "server.host", str),
    VllmFlag("--port", "server.port", int),
    VllmFlag("--max-model-len", "max_model_len", int),
    VllmFlag("--served-model-name", "server.served_model_name", str),
    VllmFlag("--api-key", "server.api_key", str),
    VllmFlag("--dtype", "dtype", str),
    VllmFlag("--seed", "seed", int),
    VllmFlag("--max-num-seqs", "scheduler.max_running_requests", int),
    VllmFlag("--max-num-batched-tokens", "scheduler.max_batch_tokens", int),
)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="YAML config file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field by its dotted name (repeatable)",
    )


def _add_vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_dir",
        nargs="?",
        default=None,
        metavar="MODEL_DIR",
        help="the model directory (config key model; default: the config's)",
    )
    for f in VLLM_FLAGS:
        p.add_argument(
            f.flag,
            dest=_dest(f.flag),
            type=f.type,
            default=None,
            metavar=f.type.__name__.upper(),
            help=f"{setting(f.key).description} (config key {f.key})",
        )


def flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The vLLM-style arguments given, as ``{flag: {config key: value}}``."""
    given = {"MODEL_DIR": ("model", getattr(args, "model_dir", None))}
    given.update({f.flag: (f.key, getattr(args, _dest(f.flag), None)) for f in VLLM_FLAGS})
    return {flag: {key: value} for flag, (key, value) in given.items() if value is not None}


def config_from_args(args: argparse.Namespace) -> HybridServeConfig:
    """Defaults <- ``--config`` <- the flags and ``--set`` (which must agree where they meet)."""
    overrides = combine_overrides({**flag_overrides(args), "--set": parse_set_items(args.overrides)})
    return load_config(args.config, overrides)


def _cmd_run_batch(args: argparse.Namespace) -> int:
    from cluster.api.run_batch import run_batch
    from workers.llm import LLM

    config = config_from_args(args)
    llm = LLM(config=config)
    lines = Path(args.input).read_text().splitlines() if args.input != "-" else sys.stdin.read().splitlines()
    results = run_batch(llm, lines, args.model_name or config.served_model_name())
    text = "".join(json.dumps(r) + "\n" for r in results)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """Start a local Ray cluster and the app; block until Ctrl-C (or SIGTERM), then stop."""
    from cluster.serve_local import serve_forever

    config = config_from_args(args)
    sidecar = None
    if args.with_prometheus:
        from cluster.observability.prometheus_local import prometheus_sidecar

        sidecar = prometheus_sidecar(config, args.prometheus_port)  # checks the binary before Ray starts
    return serve_forever(config, num_cpus=args.num_cpus, app_name=args.app_name, sidecar=sidecar)


def _cmd_bench(args: argparse.Namespace) -> int:
    from cluster.bench.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the configured model on a local Ray cluster")
    _add_vllm_args(serve)
    _add_config_args(serve)
    serve.add_argument("--num-cpus", type=int, default=None, help="CPUs the local Ray cluster may use (default: all)")
    serve.add_argument("--app-name", default="hybridserve", help="Serve application name")
    serve.add_argument(
        "--with-prometheus", action="store_true", help="also run a local Prometheus (127.0.0.1) scraping this cluster"
    )
    serve.add_argument(
        "--prometheus-port", type=int, default=9090, help="port of that Prometheus (default 9090; 0 picks a free one)"
    )
    serve.set_defaults(func=_cmd_serve)
    rb = sub.add_parser("run-batch", help="OpenAI batch JSONL in, JSONL out (no Ray)")
    _add_config_args(rb)
    rb.add_argument("-i", "--input", required=True, help="input JSONL ('-' for stdin)")
    rb.add_argument("-o", "--output", required=True, help="output JSONL ('-' for stdout)")
    rb.add_argument("--model-name", default=None, help="model name written into responses")
    rb.set_defaults(func=_cmd_run_batch)
    from cluster.bench.command import add_bench_args

    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server, or run the suite")
    add_bench_args(bench)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"hybridserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
