"""The device checks, one command per stage (``tests/gpu/run_device_checks.sh`` runs them all).

    python3 -m tests.gpu.device_checks STAGE [--dry-run] [--out DIR] [--budget-s S]

STAGE is ``env`` (versions, and whether the project imports), ``kernels`` (stage a:
``checks_kernels``), ``model`` (stage b: ``checks_model``) or ``bench`` (stage c:
``bench_stage``, its tables c, c2, c3). Each appends its markdown table to ``DIR/summary.md`` row by row (and
prints it), and exits 1 when a row failed. ``--budget-s`` is the stage's soft time limit:
rows after it are reported as skipped (the shell's ``timeout`` is the hard one, a little
later). ``--dry-run`` runs the same code on the CPU at toy sizes, Triton through its
interpreter, so that the stages are known to parse and wire up without a GPU; its numbers
mean nothing.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # Triton reads this when it is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import importlib  # noqa: E402
import platform  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from tests.gpu.common import Deadline, Report  # noqa: E402

STAGES = ("env", "kernels", "model", "bench")
TITLES = {
    "env": "Environment",
    "kernels": "(a) kernels against their torch references",
    "model": "(b) whole-model greedy equality, GPU kernels vs torch references",
    "bench": "(c) decode throughput, ~1B dense and ~2B MoE random Qwen3-Next: a step eager and "
    "captured vs the HBM bound",
}


def stage_env(report: Report, dry_run: bool) -> None:
    report.row("python", platform.python_version(), ok=True)
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else "none"
    report.row("torch", f"{torch.__version__} (cuda {torch.version.cuda}, device {gpu})", ok=cuda or dry_run)
    for name in ("triton", "transformers", "tokenizers", "safetensors", "pydantic", "yaml", "flashinfer"):
        try:
            module = importlib.import_module(name)
            report.row(name, getattr(module, "__version__", "?"), ok=True)
        except Exception as exc:  # flashinfer is optional; the others fail the row
            report.row(name, f"missing ({type(exc).__name__})", ok=name == "flashinfer")
    try:
        importlib.import_module("workers.llm")
        report.row("workers.llm", "imports", ok=True)
    except Exception as exc:
        report.row("workers.llm", f"does not import: {type(exc).__name__}: {exc}"[:160], ok=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, interpreter")
    parser.add_argument("--out", type=Path, default=None, help="folder of summary.md")
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="HBM (H200: 4.8 TB/s)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available() and args.stage != "env":
        print("no CUDA device: run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    path = None
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "summary.md"
    deadline = Deadline(args.budget_s)
    title = TITLES[args.stage] + (" -- DRY RUN (CPU, toy sizes)" if args.dry_run else "")
    if args.stage == "env":
        report = Report(path, title, ["package", "version"])
        stage_env(report, args.dry_run)
    elif args.stage == "kernels":
        from tests.gpu import checks_kernels as stage

        report = Report(path, title, stage.COLUMNS)
        device = torch.device("cpu" if args.dry_run else "cuda")
        stage.run(stage.TOY if args.dry_run else stage.FULL, device, report, deadline)
    elif args.stage == "model":
        from tests.gpu import checks_model as stage

        report = Report(path, title, stage.COLUMNS)
        stage.run(report, deadline, args.dry_run)
    else:
        from tests.gpu import bench_stage

        failures = bench_stage.run(path, title, deadline, args.dry_run, args.bandwidth_gbs, args.out)
        print(f"\n{args.stage}: {failures} failed row(s)", flush=True)
        return 1 if failures else 0
    print(f"\n{args.stage}: {report.failures} failed row(s)", flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
