"""Stream migration: a replica is killed (``ray.kill``) under several streaming clients.

Each client's prompt is first answered undisturbed (greedy, token ids returned). Then all
clients stream their prompt again at once; once every stream has tokens and the victim
holds streams, the victim is killed. Every stream must complete with no error event, its
token ids and text equal to the undisturbed answer (none lost, none repeated), its usage
the user's prompt; the ingress's ``hybridserve_stream_migrations_total`` moved. Requests
sent right after the kill that the router still gave the dead replica are retried
(``hybridserve_stream_retries_total``; counted and printed, timing decides how many).
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
import ray

from tests.reliability.conftest import index_actor, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
MODEL = "migrate"
NUM_CLIENTS = 4
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def app(deployed, tiny_qwen_dir):
    return deployed(
        MODEL,
        str(tiny_qwen_dir),
        overrides={"parallel": {"num_replicas": 2}, "ingress": {"resume_timeout_s": 20}},
        args={
            "model_name": MODEL,
            "replica": {
                "num_cpus": 1,
                "stats_interval_s": 0.2,
                "events_interval_s": 0.02,
                "health_check_period_s": 2,
                "health_check_timeout_s": 2,
                "forget_after_s": 60,
            },
        },
    )


def body(k: int) -> dict:
    return {
        "model": MODEL,
        "prompt": f"stream {k} migrates " * (2 + k),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }


class Stream:
    """One streaming completion read event by event (``tokens`` grows as they arrive)."""

    def __init__(self, base_url: str, k: int) -> None:
        self.base_url, self.k = base_url, k
        self.tokens: list[int] = []
        self.text = ""
        self.errors: list[dict] = []
        self.usage: dict | None = None
        self.done = False

    def run(self) -> Stream:
        with httpx.Client(base_url=self.base_url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=body(self.k)) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.errors.append(event["error"])
                    for choice in event.get("choices", []):
                        self.tokens += choice.get("token_ids") or []
                        self.text += choice.get("text") or ""
                    self.usage = event.get("usage") or self.usage
        return self


def streams_by_replica(http: httpx.Client) -> dict[str, int]:
    return {r["replica_id"]: r["num_streams"] for r in http.get("/debug/replicas").json()["replicas"]}


def counter(app, name: str) -> float:
    text = httpx.get(app.metrics_url, timeout=10).text
    found = re.findall(rf'^{name}{{model="{MODEL}"}} ([0-9.e+]+)$', text, re.M)
    return float(found[0]) if found else 0.0


def test_streams_of_a_killed_replica_complete_elsewhere_unchanged(app):
    idx = index_actor(MODEL)
    wait_until(lambda: len(ray.get(idx.replicas.remote())) == 2, timeout_s=120)
    reference = [Stream(app.base_url, k).run() for k in range(NUM_CLIENTS)]
    assert all(len(s.tokens) == MAX_TOKENS and not s.errors for s in reference)
    streams = [Stream(app.base_url, k) for k in range(NUM_CLIENTS)]
    threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
    for t in threads:
        t.start()
    with httpx.Client(base_url=app.base_url, timeout=30) as http:
        wait_until(lambda: all(len(s.tokens) >= 2 for s in streams), timeout_s=60, interval_s=0.01)
        by_replica = streams_by_replica(http)
        victim = max(by_replica, key=by_replica.get)
        on_victim = by_replica[victim]
        mid = [len(s.tokens) for s in streams]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed_at = time.monotonic()
        after = [Stream(app.base_url, k) for k in range(NUM_CLIENTS)]  # sent right after the kill
        after_threads = [threading.Thread(target=s.run, daemon=True) for s in after]
        for t in after_threads:
            t.start()
    for t in threads + after_threads:
        t.join(timeout=120)
    took = time.monotonic() - killed_at
    migrations, retries = (
        counter(app, "hybridserve_stream_migrations_total"),
        counter(app, "hybridserve_stream_retries_total"),
    )
    print(
        f"\n[stream migration] {NUM_CLIENTS} streams of {MAX_TOKENS} tokens, {on_victim} on the killed replica "
        f"(tokens received at the kill: {mid}); all done {took:.1f} s after it; "
        f"migrations {migrations:g}, retries {retries:g}"
    )
    for ref, got in zip(reference + reference, streams + after):
        assert got.done and not got.errors, got.errors
        assert got.tokens == ref.tokens  # none lost, none repeated, greedy output unchanged
        assert got.text == ref.text
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: warm now
        assert [got.usage[c] for c in counts] == [ref.usage[c] for c in counts]
    assert migrations >= 1
