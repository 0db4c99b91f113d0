"""The driver of the two-node tests (``test_two_nodes.py``), in its own process: one Ray
cluster per process, and the test process may hold another (``serve_session``).

    python -m tests.e2e.two_node_driver --address A --model DIR phase1
    python -m tests.e2e.two_node_driver --address A --model DIR phase2

``phase1`` starts Serve and the app (two engine replicas with the host tier and the
cluster store, device slots scarce so that checkpoints are demoted and committed), checks
that the replicas sit on both nodes, runs every session's first turn and waits until the
store holds checkpoints committed by both replicas. ``phase2`` (after the test killed the
worker node) waits for Serve to bring the lost replica back on the head, runs every
session's second turn and compares every answer with a cache-off engine in this process.
Each phase prints one JSON line: what the test asserts on.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import httpx

APP = "twonode"
SESSIONS = 12
SYSTEM_LEN = 64
ENGINE = {
    "device": "cpu",
    "dtype": "float32",
    "cache": {
        "page_size": 4,
        "max_kv_tokens": 4096,
        "max_mamba_slots": 8,
        "mamba_track_interval": 16,
        "host_mamba_slots": 64,
        "host_kv_tokens": 8192,
        "cluster_store_bytes": 256 << 20,
    },
    "scheduler": {"max_running_requests": 2, "max_batch_tokens": 512, "chunked_prefill_size": 128},
}
MAX_TOKENS = 4


def sessions(n: int) -> list[list[int]]:
    rng = random.Random(17)
    systems = [[rng.randrange(10, 400) for _ in range(SYSTEM_LEN)] for _ in range(3)]
    return [systems[i % 3] + [rng.randrange(10, 400) for _ in range(10 + i % 7)] for i in range(n)]


def follow_up(prompt: list[int], output: list[int], i: int) -> list[int]:
    return prompt + output + [11 + i, 12 + i, 13 + i]


def complete(http: httpx.Client, tokens: list[int]) -> dict[str, Any]:
    body = {
        "model": APP,
        "prompt": tokens,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = http.post("/v1/completions", json=body)
    r.raise_for_status()
    out = r.json()
    return {
        "token_ids": out["choices"][0]["token_ids"],
        "cached": out["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def store_summary() -> dict[str, Any]:
    import ray

    from cluster.actors import NAMESPACE, store_actor_name

    return ray.get(ray.get_actor(store_actor_name(APP), namespace=NAMESPACE).summary.remote())


def replica_nodes(http: httpx.Client) -> dict[str, str]:
    """Engine replica id -> node id, as the replicas report it (``/debug/replicas``)."""
    try:
        replicas = http.get("/debug/replicas").json()["replicas"]
    except (httpx.HTTPError, KeyError, ValueError):
        return {}
    return {r["replica_id"]: r["node_id"] for r in replicas}


def node_roles() -> dict[str, str]:
    import ray

    return {
        n["NodeID"]: ("head" if "node:__internal_head__" in n["Resources"] else "worker")
        for n in ray.nodes()
        if n["Alive"]
    }


def _if(value: Any, ok: Any) -> Any:
    return value if ok(value) else None


def wait(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.5)
    return value


def deploy(model: str, http_port: int) -> None:
    from ray import serve

    from cluster.app import AppArgs, build_app_from_config
    from configs.schema import load_config
    from tests.e2e.two_nodes import REPLICA_RESOURCE

    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    config = load_config(overrides={**ENGINE, "model": model, "parallel": {"num_replicas": 2}, "metrics": {"port": 0}})
    args = AppArgs.model_validate(
        {
            "model_name": APP,
            "router": {"min_match_tokens": 4},
            "replica": {
                "num_cpus": 1,
                "resources": {REPLICA_RESOURCE: 1},
                "stats_interval_s": 0.3,
                "events_interval_s": 0.05,
                "health_check_period_s": 1,
                "health_check_timeout_s": 5,
                "prefill_tokens_per_s": 200.0,
            },
            "ingress": {"resources": {"head_node": 1}},
        }
    )
    serve.run(build_app_from_config(config, args), name=APP, route_prefix=f"/{APP}")


def phase1(args: argparse.Namespace) -> dict[str, Any]:
    deploy(args.model, args.http_port)
    roles = node_roles()
    owners = {}
    with httpx.Client(base_url=f"http://127.0.0.1:{args.http_port}/{APP}", timeout=120) as http:
        placed = wait(lambda: _if(replica_nodes(http), lambda n: len(n) == 2), 120, "two replicas")
        outs = [complete(http, p) for p in sessions(args.sessions)]
        # Demotions are committed by the publishers within a few intervals.
        summary = wait(
            lambda: _if(store_summary(), lambda s: len(s["owners"]) == 2),
            60,
            "store entries committed by both replicas",
        )
        owners = {e[0].hex(): e[2] for e in summary["entries"]}
    return {
        "replica_nodes": {name: roles.get(node, "?") for name, node in placed.items()},
        "outputs": [o["token_ids"] for o in outs],
        "store_owners": owners,
        "store_objects": summary["hybridserve_store_objects"],
        "store_node": roles.get(summary["node_id"], "?"),
    }


def phase2(args: argparse.Namespace, first: dict[str, Any]) -> dict[str, Any]:
    from workers.llm import LLM
    from workers.sampling.params import SamplingParams

    roles = node_roles()
    prompts = [follow_up(p, o, i) for i, (p, o) in enumerate(zip(sessions(args.sessions), first["outputs"]))]
    with httpx.Client(base_url=f"http://127.0.0.1:{args.http_port}/{APP}", timeout=120) as http:
        placed = wait(
            lambda: _if(
                replica_nodes(http), lambda n: len(n) == 2 and all(roles.get(node) == "head" for node in n.values())
            ),
            180,
            "two replicas on the head",
        )
        outs = [complete(http, p) for p in prompts]
        stats = http.get("/debug/replicas").json()["replicas"]
    off = LLM(model=args.model, device="cpu", dtype="float32", cache={"enable_prefix_cache": False})
    ref = off.generate_ids(
        prompts, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * len(prompts)
    )
    fetches: dict[str, int] = {}
    for r in stats:
        for outcome, n in r["counters"].get("hybridserve_store_fetches_total", {}).items():
            fetches[outcome] = fetches.get(outcome, 0) + n
    return {
        "replica_nodes": {name: roles.get(node, "?") for name, node in placed.items()},
        "wrong": [i for i, (o, r) in enumerate(zip(outs, ref)) if o["token_ids"] != r.token_ids],
        "cached": [o["cached"] for o in outs],
        "prompt_lens": [len(p) for p in prompts],
        "fetches": fetches,
        "store_after": store_summary()["hybridserve_store_objects"],
        "hits": {r["replica_id"][-6:]: r["counters"].get("hybridserve_cache_hits_total", {}) for r in stats},
    }


def main() -> None:
    import ray

    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--sessions", type=int, default=SESSIONS)
    ap.add_argument("--first", default=None, help="phase 2: phase 1's JSON")
    ap.add_argument("phase", choices=["phase1", "phase2"])
    args = ap.parse_args()
    ray.init(address=args.address, logging_level="ERROR")
    result = phase1(args) if args.phase == "phase1" else phase2(args, json.loads(args.first))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
