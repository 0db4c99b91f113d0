"""HybridPrefixRouter.choose_replicas with fake replicas, index and loads (no Ray cluster)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from cluster.routing.router import HybridPrefixRouter, prompt_token_ids
from cluster.routing.router_actor import MatchReport
from cluster.serving.messages import GenerateRequest
from configs.schema import load_config
from workers.sampling.params import SamplingParams

DEP = DeploymentID(name="EngineReplica", app_name="app")


class FakeReplica:
    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(name, DEP)
        self.max_ongoing_requests = 100
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()

    @property
    def name(self) -> str:
        return self.replica_id.to_full_id_str()


class FakeRef:
    """Awaitable like an ObjectRef; never awaiting it (fire and forget) is fine too."""

    def __init__(self, result) -> None:
        self.result = result

    def __await__(self):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result
        yield  # unreachable: makes this a generator


class FakeMethod:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)
        return FakeRef(self.fn(*args))


class FakeIndex:
    def __init__(self, depths: dict[str, int] | Exception) -> None:
        self.match = FakeMethod(
            lambda tokens, ids, max_depth: (
                depths
                if isinstance(depths, Exception)
                else MatchReport({i: depths.get(i, 0) for i in ids}, dict.fromkeys(ids, 0))
            )
        )
        self.forget = FakeMethod(lambda ids: None)


class FakeMetrics:
    def __init__(self) -> None:
        self.pushed: Counter[str] = Counter()
        self.push_router = FakeMethod(lambda model, deltas: self.pushed.update(deltas))


def make_router(
    replicas: list[FakeReplica], index: FakeIndex, policy: str = "hybrid_prefix", loads: dict[str, int] | None = None
) -> tuple[HybridPrefixRouter, FakeMetrics]:
    router = HybridPrefixRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN)
    metrics = FakeMetrics()
    router_section = {"policy": policy, "min_match_tokens": 4, "push_interval_s": 0.01}
    config = load_config(overrides={"router": router_section, "server.served_model_name": "m"})
    router.initialize_state(config=config.model_dump(mode="json"), index_actor=index, metrics_actor=metrics)
    router._replicas = {r.replica_id: r for r in replicas}
    router._replica_id_set = set(router._replicas)
    router._replicas_list = list(replicas)
    for r in replicas:
        router._replica_queue_len_cache.update(r.replica_id, (loads or {}).get(r.name, 0))
    return router, metrics


def pending(tokens: list[int] | None, **kwargs) -> PendingRequest:
    args = [] if tokens is None else [GenerateRequest("r", tokens, [SamplingParams()])]
    meta = RequestMetadata(request_id="r", internal_request_id="i", call_method="generate" if tokens else "stats")
    return PendingRequest(args=args, kwargs=kwargs, metadata=meta)


def names(ranks) -> list[list[str]]:
    return [[r.name for r in rank] for rank in ranks]


def run(coro):
    return asyncio.run(coro)


def test_prefix_hit_goes_to_the_replica_holding_the_checkpoint():
    a, b = FakeReplica("a"), FakeReplica("b")
    index = FakeIndex({b.name: 12})
    router, metrics = make_router([a, b], index)

    async def go():
        ranks = await router.choose_replicas([a, b], pending(list(range(20))))
        await asyncio.sleep(0.05)  # let the decision counter be pushed
        return ranks

    assert names(run(go())) == [[b.name], [a.name]]
    assert index.match.calls[0][2] == 19  # the last prompt token must be computed
    assert metrics.pushed == {"prefix": 1}


def test_index_failure_falls_back_to_power_of_two():
    a, b = FakeReplica("a"), FakeReplica("b")
    router, metrics = make_router([a, b], FakeIndex(TimeoutError("index slow")))

    async def go():
        ranks = await router.choose_replicas([a, b], pending(list(range(20))))
        await asyncio.sleep(0.05)
        return ranks

    ranks = names(run(go()))
    assert len(ranks) == 1 and sorted(ranks[0]) == sorted([a.name, b.name])
    assert metrics.pushed == {"fallback": 1}


def test_load_beats_a_short_prefix():
    a, b = FakeReplica("a"), FakeReplica("b")
    router, _ = make_router([a, b], FakeIndex({b.name: 8}), loads={a.name: 0, b.name: 3})

    async def go():
        return await router.choose_replicas([a, b], pending(list(range(20))))

    assert names(run(go()))[0] == [a.name]


def test_targeted_and_tokenless_calls_skip_the_index():
    a, b = FakeReplica("a"), FakeReplica("b")
    index = FakeIndex({a.name: 12})
    router, _ = make_router([a, b], index)

    async def go():
        targeted = await router.choose_replicas([a, b], pending(None, target_replica=b.name))
        tokenless = await router.choose_replicas([a, b], pending(None))
        assert prompt_token_ids(pending(None)) is None and prompt_token_ids(pending([1, 2])) == [1, 2]
        return names(targeted), names(tokenless)

    targeted, tokenless = run(go())
    assert targeted == [[b.name]]
    assert sorted(tokenless[0]) == sorted([a.name, b.name])
    assert index.match.calls == []


@pytest.mark.parametrize("policy", ["round_robin", "pow2"])
def test_baseline_policies_ignore_the_index(policy):
    reps = [FakeReplica(x) for x in "abc"]
    index = FakeIndex({reps[0].name: 100})
    router, _ = make_router(reps, index, policy=policy)

    async def go():
        return [names(await router.choose_replicas(reps, pending(list(range(20))))) for _ in range(6)]

    picks = run(go())
    assert index.match.calls == []
    if policy == "round_robin":
        firsts = [p[0][0] for p in picks]
        assert firsts[:3] == firsts[3:] and len(set(firsts[:3])) == 3
        assert all(len(p) == 3 for p in picks)  # the others follow, one rank each


def test_replicas_that_leave_are_forgotten_in_the_index():
    a, b = FakeReplica("a"), FakeReplica("b")
    index = FakeIndex({})
    router, _ = make_router([a, b], index)

    async def go():
        router.update_replicas([a])  # b is gone
        router.on_replica_actor_died(a.replica_id)

    run(go())
    assert index.forget.calls == [([b.name],), ([a.name],)]


def test_a_lone_replica_is_chosen_without_asking_the_index():
    """One candidate: nothing to rank, so no index round trip on the request's path."""
    a = FakeReplica("a")
    index = FakeIndex({a.name: 12})
    router, metrics = make_router([a], index)

    async def go():
        ranks = await router.choose_replicas([a], pending(list(range(20))))
        await asyncio.sleep(0.05)
        return ranks

    assert names(run(go())) == [[a.name]]
    assert index.match.calls == []
    assert metrics.pushed == {"single": 1}
