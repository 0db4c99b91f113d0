"""Render the dashboards to JSON files; ``--check`` fails when the checked-in files differ.

python -m cluster.observability.dashboards            # rewrite deploy/grafana/dashboards/*.json
python -m cluster.observability.dashboards --check    # exit 1 if they are stale (CI)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cluster.observability.dashboards import DASHBOARDS
from cluster.observability.dashboards.model import Dashboard

OUT_DIR = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "dashboards"


def file_name(dashboard: Dashboard) -> str:
    return f"{dashboard.uid}.json"


def render(dashboard: Dashboard) -> str:
    return json.dumps(dashboard.to_grafana(), indent=2) + "\n"


def stale_files(out_dir: Path = OUT_DIR, dashboards: Sequence[Dashboard] = DASHBOARDS) -> list[Path]:
    """Files that are missing or differ from what the code renders."""
    return [
        out_dir / file_name(d)
        for d in dashboards
        if not (out_dir / file_name(d)).exists() or (out_dir / file_name(d)).read_text() != render(d)
    ]


def write(out_dir: Path = OUT_DIR, dashboards: Sequence[Dashboard] = DASHBOARDS) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in dashboards:
        path = out_dir / file_name(d)
        path.write_text(render(d))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.observability.dashboards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    parser.add_argument("--check", action="store_true", help="only check that the files are current")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.out)
        for path in stale:
            print(f"stale: {path} (regenerate with python -m cluster.observability.dashboards)", file=sys.stderr)
        return 1 if stale else 0
    for path in write(args.out):
        print(path)
    return 0
