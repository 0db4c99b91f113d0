"""``HybridPrefixRouter``: the Serve ``RequestRouter`` of the engine deployment (Ray edge).

One instance lives in every process holding a handle to ``EngineReplica`` (the ingress
replicas); the shared state is the router actor's tiered ``PrefixIndex``. Per ``generate``
call it reads the prompt's token ids from the request (``GenerateRequest``), asks the
actor for each replica's deepest usable checkpoint on its device and in its host tier,
and the cluster store's, reads loads from Serve's queue
length cache (probing what is missing), and lets ``routing_policy.decide`` rank the
replicas. Any error on that path -- actor timeout, bad request shape -- falls back to
power of two, counted as ``fallback``; routing never fails because of the index. A lone
candidate replica is returned at once, counted as ``single``: the index round trip would
sit on every request's time to first token and could not change the answer.

``policy`` (``router.policy``): ``hybrid_prefix`` (above), ``pow2`` (Serve's power of
two choices), ``round_robin`` (strict rotation; a baseline). Calls carrying
``target_replica=<full replica id>`` go to that replica under every policy (the
ingress uses it to reach each replica for ``/flush_cache`` and ``/debug/replicas``).

Decision counts (``hybridserve_router_decisions_total{reason}``) are pushed to the
metrics actor as deltas every ``push_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from cluster.actors import get_index_actor, get_metrics_actor
from cluster.routing.routing_policy import RouterSettings, RouterState, max_usable_depth, views_from
from configs.schema import HybridServeConfig

logger = logging.getLogger(__name__)


def prompt_token_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """The token ids of a ``generate`` call, or None for any other call."""
    if pending_request is None or not pending_request.args:
        return None
    ids = getattr(pending_request.args[0], "prompt_token_ids", None)
    return ids if isinstance(ids, list) and ids else None


class HybridPrefixRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(
        self, config: dict[str, Any] | None = None, index_actor: Any = None, metrics_actor: Any = None, **_: Any
    ) -> None:
        """Router kwargs from ``RequestRouterConfig``: the app's config (``model_dump``), whose
        ``router`` section this reads; the ``*_actor`` ones are for tests."""
        cfg = HybridServeConfig.model_validate(config or {})
        self._policy = cfg.router.policy
        self._settings = RouterSettings.from_config(cfg)
        self._model_name = cfg.served_model_name()
        self._index_timeout_s = cfg.router.index_timeout_s
        self._push_interval_s = cfg.router.push_interval_s
        self._rng = random.Random()
        self._state = RouterState(self._settings)  # cold placements not yet visible; the load penalty
        self._rr_counter = self._rng.randrange(1 << 16)
        self._decisions: Counter[str] = Counter()
        self._push_task: asyncio.Task[None] | None = None
        app = self._deployment_id.app_name
        self._index = index_actor or get_index_actor(app, cfg.replica.forget_after_s)
        self._metrics = metrics_actor or get_metrics_actor(app, cfg.server.host, cfg.metrics.port)

    # -- replica set changes ------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        old = set(self._replica_id_set)
        super().update_replicas(replicas)
        self._forget(old - set(self._replica_id_set))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget({replica_id})

    def _forget(self, gone: set[ReplicaID]) -> None:
        if gone and getattr(self, "_index", None) is not None:
            self._index.forget.remote([rid.to_full_id_str() for rid in gone])

    # -- routing ------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off when all are full
            target = self._targeted(candidate_replicas, pending_request)
            if target is not None:
                return [[target]]
        tokens = prompt_token_ids(pending_request)
        if tokens is None or self._policy == "pow2" or not candidate_replicas:
            return await self._pow2(candidate_replicas, pending_request)
        if self._policy == "round_robin":
            return self._round_robin(candidate_replicas)
        if len(candidate_replicas) == 1:
            self._count("single")
            return [list(candidate_replicas)]
        try:
            ranks, reason = await self._prefix_ranks(candidate_replicas, tokens)
        except Exception as exc:  # noqa: BLE001 - any failure degrades to load balancing
            logger.warning("hybrid prefix routing failed, using power of two: %r", exc)
            ranks, reason = await self._pow2(candidate_replicas, pending_request), "fallback"
        self._count(reason)
        return ranks

    def _targeted(self, candidates: list[RunningReplica], pending_request: PendingRequest) -> RunningReplica | None:
        target = pending_request.kwargs.get("target_replica") if pending_request.kwargs else None
        if not target:
            return None
        for r in candidates:
            if r.replica_id.to_full_id_str() == target:
                return r
        return None  # gone: any replica answers, the caller sees who

    async def _pow2(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas=candidates, pending_request=pending_request
        )  # type: ignore[arg-type]

    def _round_robin(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        ordered = sorted(candidates, key=lambda r: r.replica_id.to_full_id_str())
        start = self._rr_counter % len(ordered)
        self._rr_counter += 1
        return [[ordered[(start + k) % len(ordered)]] for k in range(len(ordered))]

    async def _prefix_ranks(
        self, candidates: list[RunningReplica], tokens: list[int]
    ) -> tuple[list[list[RunningReplica]], str]:
        by_id = {r.replica_id.to_full_id_str(): r for r in candidates}
        ids = list(by_id)
        report_ref = self._index.match.remote(tokens, ids, max_usable_depth(len(tokens)))
        loads = await self._loads(candidates)
        report = await asyncio.wait_for(report_ref, self._index_timeout_s)  # type: ignore[arg-type]
        now = time.monotonic()
        views = views_from(
            ids,
            report.depths,
            loads,
            report.sizes,
            self._state.recent.counts(now),
            report.host_depths,
            report.store_depth,
        )
        decision = self._state.decide(views, len(tokens), now, self._rng)
        return [[by_id[rid] for rid in rank] for rank in decision.ranks], decision.reason

    async def _loads(self, candidates: list[RunningReplica]) -> dict[str, int | None]:
        loads: dict[str, int | None] = {}
        missing = []
        for r in candidates:
            q = self._replica_queue_len_cache.get(r.replica_id)
            if q is None:
                missing.append(r)
            else:
                loads[r.replica_id.to_full_id_str()] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                loads[r.replica_id.to_full_id_str()] = q
        return loads

    # -- decision counters ----------------------------------------------------------------
    def _count(self, reason: str) -> None:
        self._decisions[reason] += 1
        if self._metrics is not None and self._push_task is None:
            self._push_task = self._event_loop.create_task(self._push_loop())

    async def _push_loop(self) -> None:
        while True:
            await asyncio.sleep(self._push_interval_s)
            if self._decisions:
                deltas, self._decisions = dict(self._decisions), Counter()
                try:
                    self._metrics.push_router.remote(self._model_name, deltas)
                except Exception:  # noqa: BLE001 - metrics must never break routing
                    logger.debug("router metrics push failed", exc_info=True)
