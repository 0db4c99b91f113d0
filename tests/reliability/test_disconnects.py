"""Disconnects: streams dropped by their clients free everything within 1 s.

16 concurrent streaming completions are each closed after their 5th token event. From
the last close, ``/debug/replicas`` is polled until the replica has no open stream, the
engine holds no request and every KV page and Mamba slot is free or owned by the prefix
cache (nothing held by a request). The time to get there is printed and must be < 1 s.
Then, after ``/flush_cache``, the pools equal their idle counts exactly and the abort
counter grew by 16.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]
MODEL = "disc"
NUM_STREAMS = 16
TOKENS_BEFORE_DROP = 5
SETTLE_BOUND_S = 1.0


@pytest.fixture(scope="module")
def app(deployed, tiny_qwen_dir):
    return deployed(
        MODEL,
        str(tiny_qwen_dir),
        args={"model_name": MODEL},
        overrides={
            "scheduler": {"max_running_requests": NUM_STREAMS, "max_batch_tokens": 512, "chunked_prefill_size": 128},
            "cache": {"page_size": 4, "max_kv_tokens": 4096, "max_mamba_slots": 64},
        },
    )


def replica(http: httpx.Client) -> dict[str, Any]:
    replicas = http.get("/debug/replicas").json()["replicas"]
    assert len(replicas) == 1, replicas
    return replicas[0]


def nothing_held(pools: dict[str, int]) -> bool:
    """Every page and slot is free or cached (the prefix cache may keep what it inserted)."""
    return (
        pools["kv_pages_free"] + pools["kv_pages_cached"] == pools["kv_pages_usable"]
        and pools["mamba_slots_free"] + pools["mamba_slots_cached"] == pools["mamba_slots_usable"]
    )


def settled(rep: dict[str, Any]) -> bool:
    return rep["num_streams"] == 0 and not rep["has_unfinished"] and nothing_held(rep["pools"])


async def stream_then_drop(client: httpx.AsyncClient, k: int) -> float:
    """Open one stream, read ``TOKENS_BEFORE_DROP`` token events, close it; the close time."""
    body = {"model": MODEL, "prompt": f"story number {k} begins", "max_tokens": 512, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        seen = 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                seen += 1
                if seen == TOKENS_BEFORE_DROP:
                    break
        assert seen == TOKENS_BEFORE_DROP
    return time.monotonic()


async def drop_all(base_url: str) -> float:
    limits = httpx.Limits(max_connections=NUM_STREAMS + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        closed = await asyncio.gather(*(stream_then_drop(client, k) for k in range(NUM_STREAMS)))
    return max(closed)


def test_dropped_streams_free_the_pools_within_a_second(app):
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        http.post("/flush_cache").raise_for_status()
        wait_until(lambda: settled(replica(http)), timeout_s=30)
        idle = replica(http)
        aborts_before = idle["counters"]["hybridserve_requests_total"].get("abort", 0)
        last_drop = asyncio.run(drop_all(app.base_url))
        polls = 0
        while True:
            rep = replica(http)
            polls += 1
            if settled(rep):
                settle_s = time.monotonic() - last_drop
                break
            assert time.monotonic() - last_drop < 30, f"not settled after 30 s: {rep}"
            time.sleep(0.01)
        print(
            f"\n[disconnects] {NUM_STREAMS} streams dropped after {TOKENS_BEFORE_DROP} tokens: "
            f"settled {settle_s * 1000:.0f} ms after the last drop ({polls} polls); pools {rep['pools']}"
        )
        aborts = rep["counters"]["hybridserve_requests_total"].get("abort", 0) - aborts_before
        assert aborts == NUM_STREAMS, rep["counters"]["hybridserve_requests_total"]
        assert settle_s < SETTLE_BOUND_S, f"settled after {settle_s:.3f} s"
        http.post("/flush_cache").raise_for_status()
        assert replica(http)["pools"] == idle["pools"]
