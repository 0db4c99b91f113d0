"""One request's time to first token and one stream's decode rate through an OpenAI server,
with the engine's share of the TTFT read from the server's own histogram.

    python -m cluster.bench.http_latency [--url http://127.0.0.1:8000] [--requests 30]
        [--prompt-len 32] [--stream-tokens 256] [--streams 3] [--seed N] [--out FILE]

Without ``--url`` it deploys the app with the default configuration (the default model,
compiled steps as the schema defaults them, the default replica and router options) on a
local Ray cluster (``serving.LocalCluster``), as ``hybridserve serve`` would.

TTFT: ``--requests`` streamed completions one after another, each a new prompt of
``--prompt-len`` random token ids (so never a prefix-cache hit), ``max_tokens`` 1: the
time from sending the request to the first event carrying a token. The server's
``hybridserve_time_to_first_token_seconds`` (its sum and count on ``/metrics``) gives the
engine's mean over the same requests (from the request's arrival in the engine to its
first output): client mean - engine mean is what the serving path adds (proxy, ingress,
routing, replica, and back).

Decode: ``--streams`` single streams of ``--stream-tokens`` tokens (``ignore_eos``), one
at a time: tok/s = the tokens after the first event / (last event - first event), the rate
a client reads; events per stream show the replica's stream pacing.

A shared machine only ever slows a run down: compare the best (min TTFT, max tok/s) of
runs interleaved with what they are compared to, and report the load averages with them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

TTFT_METRIC = "hybridserve_time_to_first_token_seconds"


class Stream(NamedTuple):
    ttft_s: float
    stamps: list[tuple[float, int]]  # (seconds since sent, tokens) of each event carrying tokens


class Client:
    """One keep-alive HTTP connection to ``base_url`` (its path is the app's prefix)."""

    def __init__(self, base_url: str, timeout_s: float = 120.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"need an http:// URL, got {base_url!r}")
        self.prefix = parts.path.rstrip("/")
        self._conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)

    def get(self, path: str) -> bytes:
        self._conn.request("GET", self.prefix + path)
        resp = self._conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:200]!r}")
        return body

    def stream(self, body: dict[str, Any]) -> Stream:
        """POST a streamed completion; stamp every event that carries token ids."""
        raw = json.dumps({**body, "stream": True, "return_token_ids": True}).encode()
        start = time.perf_counter()
        self._conn.request("POST", self.prefix + "/v1/completions", raw, {"content-type": "application/json"})
        resp = self._conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"POST /v1/completions: HTTP {resp.status}: {resp.read()[:200]!r}")
        stamps = []
        while line := resp.readline():
            if line.startswith(b"data: {"):
                num = sum(len(c.get("token_ids") or []) for c in json.loads(line[6:]).get("choices") or [])
                if num:
                    stamps.append((time.perf_counter() - start, num))
        if not stamps:
            raise RuntimeError("the stream carried no token ids")
        return Stream(stamps[0][0], stamps)

    def close(self) -> None:
        self._conn.close()


def engine_ttft(metrics_text: str) -> tuple[float, int] | None:
    """(sum of seconds, count) of the engine's TTFT histogram over every replica; None when
    the text has no such histogram (not a hybridserve server)."""
    total, count, seen = 0.0, 0, False
    for line in metrics_text.splitlines():
        if line.startswith(TTFT_METRIC + "_sum"):
            total, seen = total + float(line.rsplit(" ", 1)[1]), True
        elif line.startswith(TTFT_METRIC + "_count"):
            count += int(float(line.rsplit(" ", 1)[1]))
    return (total, count) if seen else None


def _read_engine(client: Client) -> tuple[float, int] | None:
    try:
        return engine_ttft(client.get("/metrics").decode())
    except RuntimeError:  # no /metrics
        return None


def _engine_after(client: Client, base: tuple[float, int], num: int, timeout_s: float = 15.0) -> float | None:
    """The engine's mean TTFT over the ``num`` requests after ``base``, once the replicas'
    stats pushes have counted them all (None if they do not within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (now := _read_engine(client)) is None or now[1] - base[1] < num:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.25)
    return (now[0] - base[0]) / (now[1] - base[1])


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "min": ordered[0],
        "median": statistics.median(ordered),
        "mean": statistics.fmean(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def measure_ttft(client: Client, model: str, prompts: list[list[int]]) -> dict[str, Any]:
    """Client TTFT of each prompt (one at a time, one token each) and the engine's mean."""
    base = _read_engine(client)  # None: the client's side only
    ttfts = [
        client.stream({"model": model, "prompt": p, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}).ttft_s
        for p in prompts
    ]
    out: dict[str, Any] = {"client_ms": {k: 1e3 * v for k, v in summary(ttfts).items()}}
    engine = _engine_after(client, base, len(prompts)) if base is not None else None
    if engine is not None:
        out["engine_mean_ms"] = 1e3 * engine
        out["hops_mean_ms"] = out["client_ms"]["mean"] - out["engine_mean_ms"]
    return out


def measure_stream(client: Client, model: str, prompt: list[int], num_tokens: int) -> dict[str, float]:
    got = client.stream(
        {"model": model, "prompt": prompt, "max_tokens": num_tokens, "temperature": 0.0, "ignore_eos": True}
    )
    (first, n0), (last, _) = got.stamps[0], got.stamps[-1]
    tokens = sum(n for _, n in got.stamps)
    if tokens != num_tokens or last <= first:
        raise RuntimeError(f"a stream of {num_tokens} tokens brought {tokens} in {len(got.stamps)} events")
    return {"tok_s": (tokens - n0) / (last - first), "ttft_ms": 1e3 * first, "events": len(got.stamps)}


def prompts(rng: random.Random, num: int, length: int) -> list[list[int]]:
    return [[rng.randrange(16, 500) for _ in range(length)] for _ in range(num)]


def run(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    client = Client(base_url)
    try:
        model = json.loads(client.get("/v1/models"))["data"][0]["id"]
        rng = random.Random(args.seed)
        for p in prompts(rng, 3, args.prompt_len):  # warm: first calls, routes, caches
            client.stream({"model": model, "prompt": p, "max_tokens": 2, "temperature": 0.0})
        result = {"ttft": measure_ttft(client, model, prompts(rng, args.requests, args.prompt_len))}
        streams = [
            measure_stream(client, model, p, args.stream_tokens) for p in prompts(rng, args.streams, args.prompt_len)
        ]
        result["stream"] = {"samples": streams, "best_tok_s": max(s["tok_s"] for s in streams)}
        return result
    finally:
        client.close()


def local_run(args: argparse.Namespace) -> dict[str, Any]:
    """Deploy the default configuration on a local cluster, measure, delete."""
    from cluster.bench.serving import LocalCluster

    with LocalCluster() as cluster:
        app = cluster.deploy("latency", {})
        try:
            return run(app.base_url, args)
        finally:
            cluster.delete(app)


def report(result: dict[str, Any]) -> str:
    t = result["ttft"]
    c = t["client_ms"]
    args = result["args"]
    lines = [
        f"TTFT ms ({args['requests']} requests, {args['prompt_len']}-token prompts): "
        f"min {c['min']:.1f}, median {c['median']:.1f}, mean {c['mean']:.1f}, p90 {c['p90']:.1f}"
    ]
    if "engine_mean_ms" in t:
        lines.append(
            f"  engine (arrival to output) mean {t['engine_mean_ms']:.1f}; "
            f"the serving path's hops mean {t['hops_mean_ms']:.1f}"
        )
    s = result["stream"]
    lines.append(
        f"one stream of {result['args']['stream_tokens']} tokens: tok/s "
        + ", ".join(f"{x['tok_s']:.1f} ({x['events']} events)" for x in s["samples"])
        + f"; best {s['best_tok_s']:.1f}"
    )
    lines.append(f"load average: start {result['loadavg_start']}, end {result['loadavg_end']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: deploy the default config locally)")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: the clock: no cache hits)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.prompt_len < 1 or args.stream_tokens < 3 or args.streams < 1:
        raise SystemExit(
            f"need requests >= 1, prompt-len >= 1, stream-tokens >= 3, streams >= 1; got "
            f"{args.requests}, {args.prompt_len}, {args.stream_tokens}, {args.streams}"
        )
    if args.seed is None:
        args.seed = time.time_ns()
    result: dict[str, Any] = {"args": vars(args), "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    result.update(run(args.url, args) if args.url else local_run(args))
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
