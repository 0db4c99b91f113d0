"""The routers of ``routing_sim``: ours and Ray's over their real data structures, and
two load-only baselines. Each sees what it would see in the cluster: ``choose`` gets the
prompt's token ids and every replica's ongoing requests; ``on_routed`` follows a
decision (Ray's router records the prompt there); ``on_events`` delivers a replica's
checkpoint events (after the index lag the simulator applies)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from cluster.routing.router_actor import RouterIndexState
from cluster.routing.routing_policy import RouterSettings, RouterState, max_usable_depth, views_from
from workers.cache.records import CheckpointEvicted, CheckpointInserted

ROUTERS = ("hybrid_prefix", "ray_prefix", "round_robin", "pow2")
PROPOSED = ("hybrid_prefix_kv",)  # sim-only variants, not shipped routers
Event = CheckpointInserted | CheckpointEvicted


class SimRouter(Protocol):
    name: str

    def choose(self, tokens: Sequence[int], loads: dict[str, int], now: float) -> str: ...
    def on_routed(self, tokens: Sequence[int], replica: str, now: float) -> None: ...
    def on_events(self, replica: str, events: Sequence[Event]) -> None: ...


class HybridPrefixSim:
    """``HybridPrefixRouter``'s path without Ray: the router actor's tiered index (device,
    host, store) fed the replicas' events, its match, then ``decide``."""

    name = "hybrid_prefix"

    def __init__(
        self, replicas: Sequence[str], rng: random.Random, settings: RouterSettings = RouterSettings()
    ) -> None:
        self.state = RouterIndexState(forget_after_s=float("inf"))
        self.index = self.state.index
        for r in replicas:
            self.state.apply(r, [])
        self.rng = rng
        self.routing = RouterState(settings)

    def choose(self, tokens: Sequence[int], loads: dict[str, int], now: float) -> str:
        ids = list(loads)
        report = self.state.match(tokens, ids, max_usable_depth(len(tokens)))
        return self._decide(tokens, ids, report.depths, loads, now, report.host_depths, report.store_depth)

    def _decide(
        self,
        tokens: Sequence[int],
        ids: list[str],
        depths: dict[str, int],
        loads: dict[str, int],
        now: float,
        host_depths: dict[str, int] | None = None,
        store_depth: int = 0,
    ) -> str:
        sizes = {r: self.index.num_checkpoints(r) for r in ids}
        views = views_from(ids, depths, loads, sizes, self.routing.recent.counts(now), host_depths, store_depth)
        return self.routing.decide(views, len(tokens), now, self.rng).ranks[0][0]

    def on_routed(self, tokens: Sequence[int], replica: str, now: float) -> None:
        pass

    def on_events(self, replica: str, events: Sequence[Event]) -> None:
        self.state.apply(replica, events)


class HybridPrefixKvSim(HybridPrefixSim):
    """A PROPOSAL, not the shipped router: ``hybrid_prefix`` that also credits a replica
    with the KV it must hold under its checkpoints. A replica holding a checkpoint of path
    P holds P's pages, so a prompt sharing m tokens with P will, on that replica, get a
    checkpoint at the branching point (``workers/cache/checkpoints.py``) and hit from the next
    request on. Depth = max(checkpoint depth, page-aligned shared KV depth), same
    ``decide``. Built from the same events; ``PrefixIndex`` would need per-node subtree
    owners to answer it."""

    name = "hybrid_prefix_kv"

    def __init__(
        self,
        replicas: Sequence[str],
        rng: random.Random,
        settings: RouterSettings = RouterSettings(),
        page_size: int = 16,
    ) -> None:
        super().__init__(replicas, rng, settings)
        self.page = page_size
        self.kv: dict[int, dict[str, int]] = {}  # page key -> replica -> covering checkpoints

    def _keys(self, tokens: Sequence[int]) -> list[int]:
        keys, h = [], 0
        for i in range(len(tokens) // self.page):
            h = hash((h, tuple(tokens[i * self.page : (i + 1) * self.page])))
            keys.append(h)
        return keys

    def choose(self, tokens: Sequence[int], loads: dict[str, int], now: float) -> str:
        ids = list(loads)
        limit = max_usable_depth(len(tokens))
        depths = self.index.match(tokens, limit, ids)
        for i, k in enumerate(self._keys(tokens[:limit]), start=1):
            owners = self.kv.get(k)
            if not owners:
                break
            for r in owners:
                depths[r] = max(depths.get(r, 0), i * self.page)
        return self._decide(tokens, ids, depths, loads, now)

    def on_events(self, replica: str, events: Sequence[Event]) -> None:
        super().on_events(replica, events)
        for e in events:
            step = 1 if isinstance(e, CheckpointInserted) else -1
            for k in self._keys(e.token_ids):
                owners = self.kv.setdefault(k, {})
                owners[replica] = owners.get(replica, 0) + step
                if owners[replica] <= 0:
                    del owners[replica]
                if not owners:
                    del self.kv[k]


class RayPrefixSim:
    """``PrefixCacheAffinityRouter``'s rule over Ray's own ``PrefixTree`` (ray 2.60):
    power of two when the queue spread exceeds ``imbalanced_threshold``; else the owners of
    the deepest text match when it covers >= ``match_rate_threshold`` of the prompt, else
    the tenants with the fewest characters in the tree; the shortest queue among those
    (what Serve does with a rank); the prompt text is inserted for the chosen replica.
    Tokens are rendered one character each (a token-exact text match)."""

    name = "ray_prefix"

    def __init__(
        self,
        replicas: Sequence[str],
        rng: random.Random,
        imbalanced_threshold: float = float("inf"),
        match_rate_threshold: float = 0.1,
    ) -> None:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

        self.tree = PrefixTree()
        self.tree.add_tenants(list(replicas), 0.0)
        self.rng = rng
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold

    @staticmethod
    def text(tokens: Sequence[int]) -> str:
        return "".join(chr(0x4E00 + t) for t in tokens)

    def choose(self, tokens: Sequence[int], loads: dict[str, int], now: float) -> str:
        ids = list(loads)
        if max(loads.values()) - min(loads.values()) > self.imbalanced_threshold:
            return _pow2(ids, loads, self.rng)
        text = self.text(tokens)
        matched, owners = self.tree.prefix_match(text, ids)
        if len(matched) / max(len(text), 1) < self.match_rate_threshold:
            owners = self.tree.get_smallest_tenants()
        if not owners:
            return _pow2(ids, loads, self.rng)
        return _least_loaded(owners, loads, self.rng)

    def on_routed(self, tokens: Sequence[int], replica: str, now: float) -> None:
        self.tree.insert(self.text(tokens), replica, now)

    def on_events(self, replica: str, events: Sequence[Event]) -> None:
        pass


class RoundRobinSim:
    name = "round_robin"

    def __init__(self, replicas: Sequence[str], rng: random.Random) -> None:
        self.order, self.next = sorted(replicas), rng.randrange(len(replicas))

    def choose(self, tokens: Sequence[int], loads: dict[str, int], now: float) -> str:
        self.next += 1
        return self.order[self.next % len(self.order)]

    def on_routed(self, tokens: Sequence[int], replica: str, now: float) -> None:
        pass

    def on_events(self, replica: str, events: Sequence[Event]) -> None:
        pass


class Pow2Sim(RoundRobinSim):
    name = "pow2"

    def __init__(self, replicas: Sequence[str], rng: random.Random) -> None:
        super().__init__(replicas, rng)
        self.rng = rng

    def choose(self, tokens: Sequence[int], loads: dict[str, int], now: float) -> str:
        return _pow2(list(loads), loads, self.rng)


def _pow2(ids: list[str], loads: dict[str, int], rng: random.Random) -> str:
    return _least_loaded(rng.sample(ids, min(2, len(ids))), loads, rng)


def _least_loaded(ids: Sequence[str], loads: dict[str, int], rng: random.Random) -> str:
    low = min(loads[r] for r in ids)
    return rng.choice(sorted(r for r in ids if loads[r] == low))


def make_router(
    name: str, replicas: Sequence[str], rng: random.Random, settings: RouterSettings | None = None
) -> SimRouter:
    """``settings`` are the hybrid routers' (``RouterSettings()`` when None)."""
    if settings is not None and name in ("hybrid_prefix", "hybrid_prefix_kv"):
        return (HybridPrefixSim if name == "hybrid_prefix" else HybridPrefixKvSim)(replicas, rng, settings)
    makers: dict[str, Callable[[Sequence[str], random.Random], SimRouter]] = {
        "hybrid_prefix": HybridPrefixSim,
        "hybrid_prefix_kv": HybridPrefixKvSim,
        "ray_prefix": RayPrefixSim,
        "round_robin": RoundRobinSim,
        "pow2": Pow2Sim,
    }
    if name not in makers:
        raise ValueError(f"router must be one of {ROUTERS + PROPOSED}, got {name!r}")
    return makers[name](replicas, rng)
