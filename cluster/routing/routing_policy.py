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
2. score = expected_saved - load_cost(load); the best score is preferred. Both are prefill
   tokens. With ``replica_capacity`` C known (the engine's ``max_running_requests``), a
   newcomer to a replica running fewer than C requests starts at once and shares its steps
   (a decode row each: ``load_penalty_tokens`` per ongoing request), while each request
   beyond C - 1 makes it wait for a slot: ``LoadPenalty.tokens`` each, the prefill a routed
   request is expected to compute (its prompt minus its first choice's expected saving),
   averaged over this router's recent decisions and never below ``load_penalty_tokens``.
   With C unknown (0) every ongoing request costs ``LoadPenalty.tokens``; with
   ``load_penalty_auto`` off that is ``load_penalty_tokens``. A waiting slot costs more
   than the prefill in front of it (the running requests' decodes), so this undercounts a
   queue; the imbalance gate below bounds what that can cost.
3. ``imbalanced`` (checked per request, against the preferred replica only): its load
   exceeds the least loaded by more than ``imbalance_abs`` AND by more than a factor
   ``imbalance_rel`` -> least loaded first.
4. ``prefix``: the preferred replica alone in rank 0, the others by score after it
   (Serve moves to the next rank when a replica rejects at ``max_ongoing_requests``).
``fallback`` (power of two) is the router's answer to any error, and ``single`` its answer when
there is one candidate replica (nothing to rank, so the index is not asked); neither is
decided here.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

from configs.schema import HybridServeConfig
from configs.serving import RouterConfig

REASONS = ("prefix", "imbalanced", "cold", "fallback", "single")


_DEFAULTS = RouterConfig()


@dataclass(frozen=True)
class RouterSettings:
    """What ``decide`` reads: a view of the config's ``router`` section, which validates and
    describes each field (``configs/serving.py``); build it with ``from_config``."""

    load_penalty_tokens: float = _DEFAULTS.load_penalty_tokens
    load_penalty_auto: bool = _DEFAULTS.load_penalty_auto
    replica_capacity: int = _DEFAULTS.replica_capacity  # 0: unknown (see load_cost)
    imbalance_abs: int = _DEFAULTS.imbalance_abs
    imbalance_rel: float = _DEFAULTS.imbalance_rel
    min_match_tokens: int = _DEFAULTS.min_match_tokens
    host_hit_value: float = _DEFAULTS.host_hit_value
    store_hit_value: float = _DEFAULTS.store_hit_value
    store_min_gain_tokens: int = _DEFAULTS.store_min_gain_tokens

    @classmethod
    def from_config(cls, config: HybridServeConfig) -> RouterSettings:
        """``router.replica_capacity`` 0 becomes the engine's ``scheduler.max_running_requests``."""
        router = config.router
        view = cls(**{f.name: getattr(router, f.name) for f in fields(cls)})
        capacity = router.replica_capacity or config.scheduler.max_running_requests
        return replace(view, replica_capacity=capacity)


class ReplicaView(NamedTuple):
    replica_id: str
    depth: int
    load: int
    num_checkpoints: int = 0
    recent_cold: int = 0  # this router's cold placements not yet visible
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
    ranks: list[list[str]]  # replica ids, most preferred rank first
    reason: str  # one of REASONS
    depth: int  # cached tokens expected on the first choice


def max_usable_depth(prompt_len: int) -> int:
    return max(prompt_len - 1, 0)


class LoadPenalty:
    """The prefill tokens one ongoing request on a replica is worth (module docstring,
    step 2): an exponential average, weight ``alpha`` per decision, of the prompt tokens a
    routed request is expected to compute; starts at and never drops below
    ``load_penalty_tokens``, and stays there with ``load_penalty_auto`` off."""

    def __init__(self, settings: RouterSettings, alpha: float = 1 / 32) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.floor, self.auto, self.alpha = settings.load_penalty_tokens, settings.load_penalty_auto, alpha
        self._mean: float | None = None

    @property
    def tokens(self) -> float:
        return self.floor if self._mean is None or not self.auto else max(self.floor, self._mean)

    def observe(self, prompt_len: int, expected_saved: int) -> None:
        computed = max(prompt_len - expected_saved, 1)
        self._mean = computed if self._mean is None else self._mean + self.alpha * (computed - self._mean)


def decide(
    views: Sequence[ReplicaView],
    settings: RouterSettings,
    rng: random.Random | None = None,
    penalty: float | None = None,
) -> RoutingDecision:
    """The decision of the module docstring; ``penalty`` (``LoadPenalty.tokens``) replaces
    ``settings.load_penalty_tokens`` when given."""
    if not views:
        raise ValueError("no candidate replicas to route to")
    penalty = settings.load_penalty_tokens if penalty is None else penalty
    rng = rng or random.Random()
    shuffled = list(views)
    rng.shuffle(shuffled)  # ties are broken at random, not by list order
    saved = {v.replica_id: expected_saved(v, settings) for v in views}
    if max(saved.values()) < settings.min_match_tokens:
        ordered = sorted(shuffled, key=lambda v: (v.load + v.recent_cold, v.num_checkpoints))
        return RoutingDecision(_least_loaded_ranks(ordered), "cold", 0)
    by_score = sorted(shuffled, key=lambda v: (-(saved[v.replica_id] - load_cost(v.load, settings, penalty)), v.load))
    best = by_score[0]
    min_load = min(v.load for v in views)
    if is_imbalanced(best.load, min_load, settings):
        ordered = sorted(shuffled, key=lambda v: (v.load, -saved[v.replica_id]))
        return RoutingDecision(_least_loaded_ranks(ordered), "imbalanced", round(saved[ordered[0].replica_id]))
    rest = [v.replica_id for v in by_score[1:]]
    return RoutingDecision([[best.replica_id]] + ([rest] if rest else []), "prefix", round(saved[best.replica_id]))


def load_cost(load: int, settings: RouterSettings, penalty: float) -> float:
    """The prefill tokens ``load`` ongoing requests cost a newcomer (module docstring, step 2)."""
    if settings.replica_capacity <= 0:
        return penalty * load
    waiting = max(0, load + 1 - settings.replica_capacity)
    return settings.load_penalty_tokens * (load - waiting) + penalty * waiting


def expected_saved(view: ReplicaView, settings: RouterSettings) -> float:
    """Prompt tokens a replica is expected not to recompute (see the module docstring)."""
    fetches = view.store_depth - max(view.depth, view.host_depth) >= max(settings.store_min_gain_tokens, 1)
    return max(
        float(view.depth),
        settings.host_hit_value * view.host_depth,
        settings.store_hit_value * view.store_depth if fetches else 0.0,
    )


def is_imbalanced(load: int, min_load: int, settings: RouterSettings) -> bool:
    return load - min_load > settings.imbalance_abs and load > settings.imbalance_rel * min_load


def views_from(
    candidates: Sequence[str],
    depths: Mapping[str, int],
    loads: Mapping[str, int | None],
    sizes: Mapping[str, int] | None = None,
    recent_cold: Mapping[str, int] | None = None,
    host_depths: Mapping[str, int] | None = None,
    store_depth: int = 0,
) -> list[ReplicaView]:
    sizes, recent_cold, host_depths = sizes or {}, recent_cold or {}, host_depths or {}
    return [
        ReplicaView(
            r,
            int(depths.get(r, 0)),
            int(loads.get(r) or 0),
            int(sizes.get(r, 0)),
            int(recent_cold.get(r, 0)),
            int(host_depths.get(r, 0)),
            int(store_depth),
        )
        for r in candidates
    ]


class RouterState:
    """What one router learns from its own decisions: recent cold placements (views must
    carry ``recent.counts``) and the load penalty."""

    def __init__(self, settings: RouterSettings, recent: RecentPlacements | None = None) -> None:
        self.settings = settings
        self.recent = recent or RecentPlacements()
        self.penalty = LoadPenalty(settings)

    def decide(
        self, views: Sequence[ReplicaView], prompt_len: int, now: float, rng: random.Random | None = None
    ) -> RoutingDecision:
        decision = decide(views, self.settings, rng, self.penalty.tokens)
        if decision.reason == "cold":
            self.recent.add(decision.ranks[0][0], now)
        self.penalty.observe(prompt_len, decision.depth)
        return decision


def _least_loaded_ranks(ordered: list[ReplicaView]) -> list[list[str]]:
    """Rank 0: the single first replica; rank 1: everyone else in order."""
    rest = [v.replica_id for v in ordered[1:]]
    return [[ordered[0].replica_id]] + ([rest] if rest else [])
