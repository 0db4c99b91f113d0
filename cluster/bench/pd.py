"""Prefill/decode disaggregation against colocated replicas, same engines, same load.

    hybridserve bench pd [--streams 6] [--stream-tokens 600] [--long-prompts 8] [--long-len 1536]
        [--long-every-s 0.75] [--sessions 8] [--turns 3] [--eager] [--seed 0] [--json]

Deploys on a local Ray cluster (``serving.LocalCluster``) the default configuration twice,
one app after the other: ``colocated`` (``parallel.num_replicas`` 2) and ``pd`` (one
prefill, one decode replica); both with the host tier, prefix cache, MTP and overlap as
the default has them. Per app:

- **Decode-heavy with long-prompt arrivals**: ``--streams`` streams (32-token prompts,
  ``--stream-tokens`` tokens, greedy, ``ignore_eos``, stream pacing off) and, once they
  run, ``--long-prompts`` completions of ``--long-len`` new tokens (``max_tokens`` 8), one
  every ``--long-every-s``. ITL is what the streams' clients see: each event's gap to the
  previous one, shared by the tokens it carries (vLLM's definition); p50 / p99 over every
  stream token (the streams outlast the arrivals). Throughput: every output token of both
  kinds / the time from the first request to the last answer.
- **Multi-turn**: ``--sessions`` chats of ``--turns`` turns (a 600-token first prompt;
  each later turn appends the answer and 24 new tokens): the share of follow-up turns the
  PD app sent straight to the decode replica (``hybridserve_pd_requests_total``).

Goals (issue 46): p99 ITL with PD <= 0.6x colocated, throughput >= 0.85x, follow-ups
direct >= 90 %. Two shared cores make this a proxy: each replica computes on its own core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # loaded when a run starts, not with the CLI
    import httpx

ENGINE = {"cache": {"host_mamba_slots": 64, "host_kv_tokens": 16384}, "scheduler": {"max_running_requests": 32}}
MODES = {
    "colocated": {"parallel": {"num_replicas": 2}},
    "pd": {"pd": {"prefill_replicas": 1, "decode_replicas": 1, "max_local_prefill_tokens": 64}},
}
REPLICA = {"num_cpus": 1, "stream_interval_s": 0.0, "stream_items_per_s": 0.0, "stats_interval_s": 0.5}


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 3000) for _ in range(n)]


async def stream(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> list[tuple[float, int]]:
    """(arrival time, tokens) of every event carrying tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    stamps = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True, "return_token_ids": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                n = sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
                if n:
                    stamps.append((time.perf_counter(), n))
    return stamps


async def complete(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = await http.post("/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


async def timed(call) -> tuple[float, Any]:
    """(the time the call returned, its result)."""
    result = await call
    return time.perf_counter(), result


def itls(stamps: list[tuple[float, int]]) -> list[float]:
    out = []
    for (t0, _), (t1, n) in zip(stamps, stamps[1:]):
        out += [(t1 - t0) / n] * n
    return out


async def decode_heavy(base: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    import httpx

    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await complete(http, model, ids(rng, 32), 4)  # warm
        start = time.perf_counter()
        streams = [
            asyncio.create_task(stream(http, model, ids(rng, 32), args.stream_tokens)) for _ in range(args.streams)
        ]
        await asyncio.sleep(1.0)
        longs = []
        for k in range(args.long_prompts):
            if k:
                await asyncio.sleep(args.long_every_s)
            longs.append(asyncio.create_task(timed(complete(http, model, ids(rng, args.long_len), 8))))
        done = await asyncio.gather(*streams)
        long_out = await asyncio.gather(*longs)
    ends = [s[-1][0] for s in done if s] + [end for end, _ in long_out]
    wall = max(ends) - start
    gaps = [g for s in done for g in itls(s)]
    tokens = sum(n for s in done for _, n in s) + sum(len(o) for _, o in long_out)
    q = statistics.quantiles(gaps, n=100)
    return {"itl_p50_ms": 1e3 * q[49], "itl_p99_ms": 1e3 * q[98], "output_tok_s": tokens / wall, "wall_s": wall}


async def multi_turn(base: str, model: str, args: argparse.Namespace) -> None:
    import httpx

    rng = random.Random(args.seed + 1)
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:

        async def session() -> None:
            prompt = ids(rng, 600)
            for _ in range(args.turns):
                prompt = prompt + await complete(http, model, prompt, 24) + ids(rng, 24)

        await asyncio.gather(*(session() for _ in range(args.sessions)))


def counter(metrics_url: str, name: str, label: str) -> float:
    import httpx

    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*{label}[^}}]*}} ([0-9.e+]+)$", text, re.M))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from cluster.bench.serving import LocalCluster

    if args.eager:
        os.environ["HYBRIDSERVE_COMPILE_DEFAULT"] = "0"
    out: dict[str, Any] = {"load_before": os.getloadavg()}
    with LocalCluster() as cluster:
        for mode, extra in MODES.items():
            app = cluster.deploy(mode, {**ENGINE, **extra}, replica=REPLICA)
            out[mode] = asyncio.run(decode_heavy(app.base_url, mode, args))
            if mode == "pd":
                before = counter(app.metrics_url, "hybridserve_pd_requests_total", 'route="direct"')
                asyncio.run(multi_turn(app.base_url, mode, args))
                time.sleep(1.0)
                direct = counter(app.metrics_url, "hybridserve_pd_requests_total", 'route="direct"') - before
                out["pd"]["follow_ups_direct"] = direct / (args.sessions * (args.turns - 1))
            cluster.delete(app)
    out["itl_p99_ratio"] = out["pd"]["itl_p99_ms"] / out["colocated"]["itl_p99_ms"]
    out["throughput_ratio"] = out["pd"]["output_tok_s"] / out["colocated"]["output_tok_s"]
    out["load_after"] = os.getloadavg()
    return out


def add_args(p: argparse.ArgumentParser | Any) -> None:
    """The options (``hybridserve bench pd`` adds them as a group; ``--seed`` and ``--json``
    are the bench command's own)."""
    p.add_argument("--streams", type=int, default=6, help="pd: decode-heavy streams")
    p.add_argument("--stream-tokens", type=int, default=600, help="pd: tokens per stream")
    p.add_argument("--long-prompts", type=int, default=8, help="pd: long prompts arriving while they run")
    p.add_argument("--long-len", type=int, default=1536, help="pd: new tokens per long prompt")
    p.add_argument("--long-every-s", type=float, default=0.75, help="pd: seconds between long prompts")
    p.add_argument("--sessions", type=int, default=8, help="pd: multi-turn chats")
    p.add_argument("--turns", type=int, default=3, help="pd: turns per chat")
    p.add_argument("--eager", action="store_true", help="pd: engines without compiled steps")


def run_command(args: argparse.Namespace) -> int:
    """Shared by ``main`` and ``hybridserve bench pd``."""
    if args.seed is None:
        args.seed = 0
    print(json.dumps(run(args), indent=None if args.json else 2))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="the result on one line")
    return run_command(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
