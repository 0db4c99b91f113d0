"""Run a checked soak against a server; exit status 1 when any check fails.

    python -m tests.reliability.run_soak --base-url http://127.0.0.1:8000/APP --duration-s 600 \\
        [--warmup-s 60 --concurrency 8 --ray-app APP --ray-address HOST:PORT]

The load is ``soak``, the server-side checks ``soak_server`` (both beside this file).
``--ray-app`` joins the Ray cluster to read the replicas' RSS; a cluster with Ray's token
authentication also needs ``RAY_AUTH_MODE=token`` in this command's environment.
"""

from __future__ import annotations

import argparse

from cluster.bench.workloads import Renderer
from tests.reliability.soak import SoakSettings
from tests.reliability.soak_server import replica_pids, run_checked


def main(argv: list[str] | None = None) -> int:
    """Run a checked soak against a server; exit status 1 when any check fails."""
    p = argparse.ArgumentParser(prog="python -m tests.reliability.run_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the app's URL (above /v1, where /debug/replicas is)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--warmup-s", type=float, default=None, help="default: a tenth of the duration")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--stream-frac", type=float, default=0.5)
    p.add_argument("--disconnect-frac", type=float, default=0.05)
    p.add_argument("--invalid-frac", type=float, default=0.01)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer dir for text prompts (default: words)")
    p.add_argument(
        "--ray-app", default=None, help="Serve app name: join the local Ray cluster and check the replicas' RSS"
    )
    p.add_argument("--ray-address", default="auto", help="with --ray-app: the cluster's GCS address")
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    args = p.parse_args(argv)
    settings = SoakSettings(
        args.duration_s,
        args.duration_s / 10 if args.warmup_s is None else args.warmup_s,
        args.concurrency,
        args.stream_frac,
        args.disconnect_frac,
        args.invalid_frac,
        args.request_timeout_s,
        args.seed,
    )
    pids: list[int] = []
    if args.ray_app:
        import ray

        ray.init(address=args.ray_address, log_to_driver=False)
        pids = sorted(replica_pids(args.ray_app).values())
    result = run_checked(args.base_url, settings, args.api_key, Renderer.from_path(args.tokenizer), pids)
    print(result.format())
    problems = result.problems(args.max_rss_growth)
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
