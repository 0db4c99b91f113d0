"""Hand-offs between a prefill and a decode replica (Ray-free; the replicas wire them).

A prefill replica runs a prompt to its first token (``GenerateRequest.prefill_only``), then
exports the prompt's deepest checkpoint with the KV of its path (``Engine.export_prompt``:
state, KV -- the MTP head's layers included -- token path, prefix hash, model fingerprint)
into its ``HandoffStash`` and ends the stream with a ``Handoff`` carrying a
``HandoffTicket``. The decode replica pulls the payload from that replica by the ticket
(``HandoffSource``) before it queues the request, and imports it as the cluster store's
fetch does: validated (depth, hash, fingerprint, every tensor's shape and bytes), placed in
its host tier, promoted at admission, inserted in its own radix tree -- so the next turn
hits there. Whatever goes wrong (the prefill replica died, the pull timed out, the payload
does not fit) costs a local prefill, never an error; ``hybridserve_pd_transfers_total``
says which. A payload nobody takes is dropped after ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # these modules load torch
    from cluster.serving.engine_loop import EngineLoop
    from workers.tiers.payload import CheckpointPayload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandoffTicket:
    replica_id: str  # the prefill replica holding the payload
    key: str
    depth: int  # tokens of the prompt its checkpoint covers
    nbytes: int


class HandoffStash:
    """A prefill replica's exported payloads until taken (once) or ``ttl_s`` old; at most
    ``max_entries`` (the oldest goes first)."""

    def __init__(self, ttl_s: float, max_entries: int = 256, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[str, tuple[float, CheckpointPayload]] = OrderedDict()
        self._keys = itertools.count()
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, payload: CheckpointPayload) -> str:
        self.expire()
        key = f"h{next(self._keys)}"
        self._entries[key] = (self._clock(), payload)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.num_expired += 1
        return key

    def take(self, key: str) -> CheckpointPayload | None:
        self.expire()
        entry = self._entries.pop(key, None)
        return None if entry is None else entry[1]

    def expire(self) -> int:
        cutoff, n = self._clock() - self.ttl_s, 0
        while self._entries and next(iter(self._entries.values()))[0] < cutoff:
            self._entries.popitem(last=False)
            n += 1
        self.num_expired += n
        return n


class HandoffSource(Protocol):
    """Where a decode replica pulls a ticket's payload (None: it is gone)."""

    async def take(self, ticket: HandoffTicket) -> CheckpointPayload | None: ...


async def export_handoff(
    loop: EngineLoop, stash: HandoffStash, replica_id: str, prompt: list[int]
) -> HandoffTicket | None:
    """Stash the prompt's checkpoint after its prefill; None when the engine holds none."""
    payload = await loop.run(lambda e: e.export_prompt(prompt))
    expired = stash.num_expired
    ticket = None if payload is None else HandoffTicket(replica_id, stash.put(payload), payload.depth, payload.nbytes)
    outcome = "exported" if ticket is not None else "no_checkpoint"
    gone = stash.num_expired - expired

    def count(engine: Any) -> None:
        engine.stats.inc("hybridserve_pd_handoffs_total", label=outcome)
        if gone:
            engine.stats.inc("hybridserve_pd_handoffs_total", gone, label="expired")

    await loop.run(count)
    return ticket


async def import_handoff(loop: EngineLoop, source: HandoffSource, ticket: HandoffTicket, timeout_s: float) -> str:
    """Pull and import a hand-off before its request is queued; the outcome (counted)."""
    start = time.monotonic()
    try:
        payload = await asyncio.wait_for(source.take(ticket), timeout_s)
    except asyncio.TimeoutError:
        payload, outcome = None, "timeout"
    except Exception:  # noqa: BLE001 - the prefill replica died or failed: prefill here
        logger.warning("pulling hand-off %s failed", ticket, exc_info=True)
        payload, outcome = None, "lost"
    else:
        outcome = "lost" if payload is None else ""
    elapsed = time.monotonic() - start

    def place(engine: Any) -> str:
        placed = outcome
        if payload is not None:
            try:
                placed = engine.import_checkpoint(payload)
            except Exception:  # noqa: BLE001 - a payload that cannot be placed costs a prefill
                logger.warning("importing hand-off %s failed", ticket, exc_info=True)
                placed = "error"
        engine.stats.inc("hybridserve_pd_transfers_total", label=placed)
        if placed == "imported":
            engine.stats.inc("hybridserve_pd_transfer_bytes_total", payload.nbytes)
            engine.stats.observe("hybridserve_pd_transfer_seconds", elapsed)
        return placed

    return await loop.run(place)


class LocalHandoffs:
    """``HandoffSource`` over stashes in this process, by replica id (tests, benches)."""

    def __init__(self) -> None:
        self.stashes: dict[str, HandoffStash] = {}

    async def take(self, ticket: HandoffTicket) -> CheckpointPayload | None:
        stash = self.stashes.get(ticket.replica_id)
        return None if stash is None else stash.take(ticket.key)
