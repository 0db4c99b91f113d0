"""The Ray side of prefill/decode disaggregation: deployment names, the decode replicas'
pull of a hand-off from the prefill replica that holds it (a handle call routed to that
replica by ``target_replica``), and the ingress's decode-side depth from the router index."""

from __future__ import annotations

import time
from typing import Any

from cluster.pd.handoff import HandoffTicket
from cluster.routing.routing_policy import max_usable_depth

PREFILL_DEPLOYMENT = "PDPrefill"
DECODE_DEPLOYMENT = "PDDecode"
ROLES = {PREFILL_DEPLOYMENT: "prefill", DECODE_DEPLOYMENT: "decode"}


def in_deployment(replica_id: str, deployment: str) -> bool:
    """Whether a Serve replica id (``app#deployment#unique``) belongs to ``deployment``."""
    return f"#{deployment}#" in f"#{replica_id}"


class RayHandoffSource:
    """``HandoffSource`` over the prefill deployment's handle."""

    def __init__(self, prefill_handle: Any) -> None:
        self._handle = prefill_handle

    async def take(self, ticket: HandoffTicket) -> Any:
        # a gone replica: the router sends the call to another, which has no such key (None)
        return await self._handle.take_handoff.remote(ticket.key, target_replica=ticket.replica_id)


class DecodeDepths:
    """The ingress's ``DecodeDepth``: the deepest checkpoint (device or host) any decode
    replica holds for a prompt, from the router index (replica list cached ``ttl_s``)."""

    def __init__(self, index: Any, ttl_s: float = 1.0) -> None:
        self._index, self._ttl_s = index, ttl_s
        self._ids: list[str] = []
        self._fetched = -1.0

    async def __call__(self, tokens: list[int]) -> int:
        now = time.monotonic()
        if now - self._fetched > self._ttl_s:
            ids = await self._index.replicas.remote()
            self._ids, self._fetched = [r for r in ids if in_deployment(r, DECODE_DEPLOYMENT)], now
        if not self._ids:
            return 0
        report = await self._index.match.remote(tokens, self._ids, max_usable_depth(len(tokens)))
        return max([0, *report.depths.values(), *report.host_depths.values()])
