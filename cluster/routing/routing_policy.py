"""The hybrid-prefix routing decision as a pure function (no Ray; tested with fakes).

Per request, for every candidate replica we know:
- ``depth``: tokens covered by its deepest Mamba checkpoint on the prompt's path, capped
  at ``len(prompt) - 1`` (the last prompt token must be computed to get logits, and a
  recurrent state cannot be rolled back, so a checkpoint at the full length is unusable);
  ``host_depth`` the same in its host tier, ``store_depth`` in the cluster store (the
  same for every replica: any of them can fetch it);
- ``load``: its ongoing requests (Serve's queue length; unknown counts as 0);
- ``num_checkpoints``: how much it caches overall (spreads cold prompts).

``expected_saved`` is the recompute a replica is expected to save: the best of its device
depth, its host depth times ``host_hit_value`` and the store's depth times
``store_hit_value`` (a host hit costs a host -> device copy, a store hit a fetch over the
network; the values are those costs' discounts). The store counts only where the replica
would fetch: its entry must be ``store_min_gain_tokens`` deeper than the replica's own
device or host depth (the fetch cost model's break-even, ``workers/tiers/cost.py``:
shallower gains are recomputed, so crediting them sends a request where it computes
everything the store was supposed to save).

Decision, in order:
1. ``cold``: no replica expects to save ``min_match_tokens`` -> least loaded first, then the
   smallest index (so distinct prefixes spread out), random among ties. "Loaded" counts
   the cold placements this router made in the last few seconds (``RecentPlacements``):
   until Serve's queue-length cache and the replica's checkpoint events catch up, a burst
   of new prefixes would otherwise all see the same least-loaded replica.
2. score = expected_saved - load_penalty_tokens * load; the best score is preferred.
3. ``imbalanced`` (checked per request, against the preferred replica only): its load
   exceeds the least loaded by more than ``imbalance_abs`` AND by more than a factor
   ``imbalance_rel`` -> least loaded first.
4. ``prefix``: the preferred replica alone in rank 0, the others by score after it
   (Serve moves to the next rank when a replica rejects at ``max_ongoing_requests``).
``fallback`` (power of two) is the router's answer to any error; it is not decided here.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

REASONS = ("prefix", "imbalanced", "cold", "fallback")


@dataclass(frozen=True)
class RouterSettings:
    load_penalty_tokens: float = 16.0     # tokens of cached prefix worth one queued request
    imbalance_abs: int = 8
    imbalance_rel: float = 1.5
    min_match_tokens: int = 16
    host_hit_value: float = 0.9           # a host-tier token saves this much of a device one
    store_hit_value: float = 0.5          # ... and a cluster-store token
    store_min_gain_tokens: int = 0        # a store entry must beat the local depth by this

    def __post_init__(self) -> None:
        if not (0 <= self.store_hit_value <= self.host_hit_value <= 1):
            raise ValueError(f"tier values must satisfy 0 <= store_hit_value ({self.store_hit_value}) <= "
                             f"host_hit_value ({self.host_hit_value}) <= 1")
        if self.load_penalty_tokens < 0 or self.imbalance_abs < 0 or self.imbalance_rel < 1.0:
            raise ValueError(
                f"router settings out of range: load_penalty_tokens={self.load_penalty_tokens} "
                f"(>= 0), imbalance_abs={self.imbalance_abs} (>= 0), "
                f"imbalance_rel={self.imbalance_rel} (>= 1)")
        if self.store_min_gain_tokens < 0:
            raise ValueError(f"store_min_gain_tokens must be >= 0, got {self.store_min_gain_tokens}")
        if self.min_match_tokens < 1:
            raise ValueError(f"min_match_tokens must be >= 1, got {self.min_match_tokens}")


class ReplicaView(NamedTuple):
    replica_id: str
    depth: int
    load: int
    num_checkpoints: int = 0
    recent_cold: int = 0                  # this router's cold placements not yet visible
    host_depth: int = 0
    store_depth: int = 0


class RecentPlacements:
    """Cold placements made in the last ``window_s`` seconds, per replica (times are the
    caller's clock; they must not go backwards)."""

    def __init__(self, window_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._placed: deque[tuple[float, str]] = deque()

    def add(self, replica_id: str, now: float) -> None:
        self._placed.append((now, replica_id))

    def counts(self, now: float) -> dict[str, int]:
        while self._placed and self._placed[0][0] <= now - self.window_s:
            self._placed.popleft()
        out: dict[str, int] = {}
        for _, rid in self._placed:
            out[rid] = out.get(rid, 0) + 1
        return out


class RoutingDecision(NamedTuple):
    ranks: list[list[str]]                # replica ids, most preferred rank first
    reason: str                           # one of REASONS
    depth: int                            # cached tokens expected on the first choice


def max_usable_depth(prompt_len: int) -> int:
    return max(prompt_len - 1, 0)


def decide(views: Sequence[ReplicaView], settings: RouterSettings,
           rng: random.Random | None = None) -> RoutingDecision:
    if not views:
        raise ValueError("no candidate replicas to route to")
    rng = rng or random.Random()
    shuffled = list(views)
    rng.shuffle(shuffled)                 # ties are broken at random, not by list order
    saved = {v.replica_id: expected_saved(v, settings) for v in views}
    if max(saved.values()) < settings.min_match_tokens:
        ordered = sorted(shuffled, key=lambda v: (v.load + v.recent_cold, v.num_checkpoints))
        return RoutingDecision(_least_loaded_ranks(ordered), "cold", 0)
    by_score = sorted(shuffled, key=lambda v: (-(saved[v.replica_id] - settings.load_penalty_tokens * v.load),
                                               v.load))
    best = by_score[0]
    min_load = min(v.load for v in views)
    if is_imbalanced(best.load, min_load, settings):
        ordered = sorted(shuffled, key=lambda v: (v.load, -saved[v.replica_id]))
        return RoutingDecision(_least_loaded_ranks(ordered), "imbalanced", round(saved[ordered[0].replica_id]))
    rest = [v.replica_id for v in by_score[1:]]
    return RoutingDecision([[best.replica_id]] + ([rest] if rest else []), "prefix", round(saved[best.replica_id]))


def expected_saved(view: ReplicaView, settings: RouterSettings) -> float:
    """Prompt tokens a replica is expected not to recompute (see the module docstring)."""
    fetches = view.store_depth - max(view.depth, view.host_depth) >= max(settings.store_min_gain_tokens, 1)
    return max(float(view.depth), settings.host_hit_value * view.host_depth,
               settings.store_hit_value * view.store_depth if fetches else 0.0)


def is_imbalanced(load: int, min_load: int, settings: RouterSettings) -> bool:
    return (load - min_load > settings.imbalance_abs
            and load > settings.imbalance_rel * min_load)


def views_from(candidates: Sequence[str], depths: Mapping[str, int], loads: Mapping[str, int | None],
               sizes: Mapping[str, int] | None = None, recent_cold: Mapping[str, int] | None = None,
               host_depths: Mapping[str, int] | None = None, store_depth: int = 0) -> list[ReplicaView]:
    sizes, recent_cold, host_depths = sizes or {}, recent_cold or {}, host_depths or {}
    return [ReplicaView(r, int(depths.get(r, 0)), int(loads.get(r) or 0), int(sizes.get(r, 0)),
                        int(recent_cold.get(r, 0)), int(host_depths.get(r, 0)), int(store_depth))
            for r in candidates]


def decide_and_record(views: Sequence[ReplicaView], settings: RouterSettings, recent: RecentPlacements,
                      now: float, rng: random.Random | None = None) -> RoutingDecision:
    """``decide``, remembering a cold placement in ``recent`` (views must carry its counts)."""
    decision = decide(views, settings, rng)
    if decision.reason == "cold":
        recent.add(decision.ranks[0][0], now)
    return decision


def _least_loaded_ranks(ordered: list[ReplicaView]) -> list[list[str]]:
    """Rank 0: the single first replica; rank 1: everyone else in order."""
    rest = [v.replica_id for v in ordered[1:]]
    return [[ordered[0].replica_id]] + ([rest] if rest else [])
