"""Two replicas: hybrid-prefix routing finds the replica holding the checkpoint, round
robin does not; a killed replica leaves the router index."""

from __future__ import annotations

import random

import openai
import pytest
import ray

from cluster.routing.routing_policy import max_usable_depth
from tests.e2e.conftest import index_actor, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
NUM_PREFIXES = 10
PAGE = 4  # SMALL_ENGINE's page size


def prompts(seed: int) -> list[tuple[list[int], list[int]]]:
    """(base, follow-up) pairs: the follow-up repeats the base or extends it."""
    rng = random.Random(seed)
    pairs = []
    for k in range(NUM_PREFIXES):
        base = [rng.randrange(10, 400) for _ in range(PAGE * 6 + 3)]  # not page aligned
        follow = list(base) if k % 2 == 0 else base + [rng.randrange(10, 400) for _ in range(9)]
        pairs.append((base, follow))
    return pairs


def complete(client: openai.OpenAI, model: str, tokens: list[int]) -> int:
    out = client.completions.create(model=model, prompt=tokens, max_tokens=2, temperature=0)
    return out.usage.prompt_tokens_details.cached_tokens


def indexed_somewhere(app_name: str, tokens: list[int]) -> bool:
    idx = index_actor(app_name)
    replicas = ray.get(idx.replicas.remote())
    report = ray.get(idx.match.remote(tokens, replicas, max_usable_depth(len(tokens))))
    return max(report.depths.values(), default=0) > 0


def hit_rate(app, seed: int) -> float:
    client = openai.OpenAI(base_url=app.openai_base, api_key="none", max_retries=0, timeout=60)
    hits = 0
    for base, follow in prompts(seed):
        complete(client, app.name, base)
        # the checkpoint event reaches the router actor asynchronously (every ~20 ms)
        wait_until(lambda: indexed_somewhere(app.name, base), timeout_s=10)
        hits += complete(client, app.name, follow) > 0
    return hits / NUM_PREFIXES


@pytest.fixture(scope="module")
def hybrid_app(deployed, tiny_qwen_dir):
    return deployed(
        "hp",
        str(tiny_qwen_dir),
        overrides={"parallel": {"num_replicas": 2}},
        args={
            "model_name": "hp",
            "replica": {"num_cpus": 1, "stats_interval_s": 0.2, "events_interval_s": 0.02, "forget_after_s": 60},
        },
    )


def test_hybrid_prefix_routes_repeats_to_the_checkpoint(hybrid_app):
    rate = hit_rate(hybrid_app, seed=1)
    assert rate >= 0.9, f"hybrid_prefix hit rate {rate}"
    summary = ray.get(index_actor("hp").summary.remote())
    # both replicas got some of the distinct prefixes (cold prompts are spread)
    assert len(summary["checkpoints"]) == 2 and all(n > 0 for n in summary["checkpoints"].values())


def test_router_decisions_reach_the_metrics(hybrid_app):
    import httpx

    def decisions():  # every reason is exported, at 0 until counted
        text = httpx.get(hybrid_app.metrics_url, timeout=10).text
        series = 'hybridserve_router_decisions_total{model="hp",reason="prefix"} '
        return any(line.startswith(series) and float(line.split()[-1]) > 0 for line in text.splitlines())

    wait_until(decisions, timeout_s=15)


def test_killed_replica_is_dropped_from_the_index(hybrid_app):
    idx = index_actor("hp")
    before = ray.get(idx.replicas.remote())
    assert len(before) == 2
    victim = before[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    def forgotten():
        summary = ray.get(idx.summary.remote())
        return victim not in summary["checkpoints"] and victim not in summary["replicas"]

    wait_until(forgotten, timeout_s=60, interval_s=0.2)
    # the deployment heals and routing keeps working
    client = openai.OpenAI(base_url=hybrid_app.openai_base, api_key="none", max_retries=2, timeout=60)
    wait_until(lambda: len(ray.get(idx.replicas.remote())) == 2, timeout_s=90, interval_s=0.5)
    assert client.completions.create(model="hp", prompt=[5, 6, 7], max_tokens=2).usage.completion_tokens == 2


@pytest.fixture(scope="module")
def round_robin_app(deployed, tiny_qwen_dir, hybrid_app):
    from ray import serve

    serve.delete(hybrid_app.name)  # free the two engines first (2 cores)
    return deployed(
        "rr",
        str(tiny_qwen_dir),
        overrides={"parallel": {"num_replicas": 2}, "router": {"policy": "round_robin"}},
        args={"model_name": "rr"},
    )


def test_round_robin_does_not_follow_the_checkpoint(round_robin_app):
    rate = hit_rate(round_robin_app, seed=1)
    assert rate <= 0.5, f"round_robin hit rate {rate}"
