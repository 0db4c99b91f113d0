"""Why a prompt token was computed rather than cached (``python -m cluster.bench.tiers --explain``).

Per request, at the moment it is routed, six depths on its prompt's path (all capped at
``len(prompt) - 1``, the deepest a hit can resume from), each clamped to lie between the
request's actual hit ``cached`` and the depth above it, so that they fall monotonically:

    prompt      len(prompt)
    sent        the longest prefix shared with any earlier prompt or earlier prompt + output
    seen        the same, over what is computed by now (prompts whose prefill finished,
                prompts + outputs of finished requests): an ideal cache could resume there
    oracle      ``seen`` rounded down to a page (a hit covers whole pages)
    ever        the deepest checkpoint any replica ever published on the path
    alive       the deepest checkpoint that still exists anywhere (any replica's device or
                host tier, the cluster store)
    reachable   the deepest one the chosen replica can use: its own device or host tier,
                or the store
    cached      what the request got (``usage.cached_tokens``)

and the computed tokens ``prompt - cached`` are the gaps between them, by cause:

    new           prompt - sent, split into ``first_system`` (a system prompt's first
                  sight in the cluster) and ``new_suffix`` (the turn's new content; the
                  last prompt token is always computed): unavoidable
    in_flight     sent - seen: shared with a prompt still being prefilled (only waiting
                  for it could save these)
    page          seen - oracle: page rounding
    no_checkpoint oracle - ever, split into ``previous_output`` (the part past the
                  previous turn's prompt: its answer, which no checkpoint covers) and
                  ``placement`` (inside the previous prompt: no checkpoint at that depth,
                  e.g. between the track grid points)
    dropped       ever - alive: evicted from every tier (device slots, host pool, store budget)
    elsewhere     alive - reachable: only on another replica (a routing cost)
    unused        reachable - cached: reachable but not used, split into ``refused`` (the
                  store fetch's cost model chose to recompute) and ``lost_in_queue`` (gone
                  or not promoted by the time the request was admitted)

What the engines hold is read without touching any LRU order (``peek``); the store by
scanning its entries. Two ideal cached fractions: ``oracle_cached_fraction``, every
page-aligned prefix shared with anything sent before (``sent``: the workload's bound), and
``oracle_computed_fraction``, with what was computed by then (``oracle``: the bound given
the arrival times).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.routing.prefix_index import PrefixIndex
from cluster.store.checkpoint_store import CheckpointStore
from workers.cache.records import CheckpointInserted

CAUSES = (
    "first_system",
    "new_suffix",
    "in_flight",
    "page",
    "previous_output",
    "placement",
    "dropped",
    "elsewhere",
    "refused",
    "lost_in_queue",
)


@dataclass
class Snapshot:
    """The depths of one request at routing time (unclamped)."""

    prompt: int
    sent: int
    seen: int
    oracle: int
    ever: int
    alive: int
    reachable: int
    system_len: int
    previous_prompt: int  # the previous turn's prompt length (0 on a first turn)
    page: int = 16
    fetch: str = "none"  # the store prefetch's outcome


@dataclass
class Explanation:
    """Computed prompt tokens by cause, summed over requests, and the oracle's fraction."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    oracle_tokens: int = 0
    sent_oracle_tokens: int = 0
    computed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))

    def _fraction(self, n: int) -> float:
        return round(n / self.prompt_tokens, 4) if self.prompt_tokens else 0.0

    def add(self, snap: Snapshot, cached: int) -> None:
        self.prompt_tokens += snap.prompt
        self.cached_tokens += cached
        self.oracle_tokens += snap.oracle
        self.sent_oracle_tokens += snap.sent // snap.page * snap.page
        for cause, n in split(snap, cached).items():
            self.computed[cause] += n

    def as_dict(self) -> dict[str, Any]:
        total = self.prompt_tokens or 1
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "oracle_cached_fraction": self._fraction(self.sent_oracle_tokens),
            "oracle_computed_fraction": self._fraction(self.oracle_tokens),
            "computed_by_cause": dict(self.computed),
            "computed_fraction_by_cause": {k: round(v / total, 4) for k, v in self.computed.items()},
        }


def split(snap: Snapshot, cached: int) -> dict[str, int]:
    """The waterfall of one request (see the module doc); the values sum to prompt - cached."""
    levels = [snap.prompt]
    for depth in (snap.sent, snap.seen, snap.oracle, snap.ever, snap.alive, snap.reachable):
        levels.append(max(cached, min(depth, levels[-1])))
    prompt, sent, seen, oracle, ever, alive, reach = levels
    out = dict.fromkeys(CAUSES, 0)
    system_gap = max(0, min(snap.system_len, prompt) - sent)
    out["first_system"] = system_gap
    out["new_suffix"] = prompt - sent - system_gap
    out["in_flight"] = sent - seen
    out["page"] = seen - oracle
    past = max(0, oracle - max(ever, snap.previous_prompt)) if snap.previous_prompt else 0
    out["previous_output"] = past
    out["placement"] = oracle - ever - past
    out["dropped"] = ever - alive
    out["elsewhere"] = alive - reach
    out["refused" if snap.fetch == "recomputed" else "lost_in_queue"] = reach - cached
    assert sum(out.values()) == prompt - cached, (snap, cached, out)
    return out


class _Seen:
    """A token trie of everything computed so far (the oracle's memory)."""

    def __init__(self) -> None:
        self.root: dict[int, Any] = {}

    def add(self, tokens: Sequence[int]) -> None:
        node = self.root
        for t in tokens:
            node = node.setdefault(t, {})

    def shared(self, tokens: Sequence[int]) -> int:
        node, n = self.root, 0
        for t in tokens:
            nxt = node.get(t)
            if nxt is None:
                break
            node, n = nxt, n + 1
        return n


class Explainer:
    """Watches a ``bench/tiers._Cluster`` run: ``on_route`` before a request is submitted,
    ``on_events`` with every replica's drained events, ``on_prefilled`` at its first
    token, ``on_done`` when it finishes."""

    def __init__(self, engines: dict[str, Any], store: CheckpointStore | None, page_size: int) -> None:
        self.engines, self.store, self.page = engines, store, page_size
        self.sent, self.seen = _Seen(), _Seen()
        self.ever = PrefixIndex()
        self.snaps: dict[str, Snapshot] = {}
        self.result = Explanation()

    def on_events(self, events: Sequence[Any]) -> None:
        for e in events:
            if isinstance(e, CheckpointInserted):
                self.ever.insert("ever", e.token_ids)

    def on_route(self, rid: str, prompt: Sequence[int], replica: str, system_len: int, previous_prompt: int) -> None:
        limit = max(len(prompt) - 1, 0)
        usable = list(prompt[:limit])
        sent, seen = min(self.sent.shared(prompt), limit), min(self.seen.shared(prompt), limit)
        depths = {name: self._local(engine, usable) for name, engine in self.engines.items()}
        store = self._store_depth(usable)
        ever = self.ever.match(usable, limit, ["ever"])["ever"]
        alive = max([store] + list(depths.values()))
        self.snaps[rid] = Snapshot(
            len(prompt),
            sent,
            seen,
            seen // self.page * self.page,
            max(ever, alive),
            alive,
            max(depths[replica], store),
            system_len,
            previous_prompt,
            self.page,
        )
        self.sent.add(prompt)

    def on_prefilled(self, prompt: Sequence[int]) -> None:
        self.seen.add(prompt)

    def on_fetch(self, rid: str, outcome: str) -> None:
        self.snaps[rid].fetch = outcome

    def on_done(self, rid: str, tokens: Sequence[int], cached: int) -> None:
        self.sent.add(tokens)
        self.seen.add(tokens)
        self.result.add(self.snaps.pop(rid), cached)

    @staticmethod
    def _local(engine: Any, usable: list[int]) -> int:
        tree, host = engine.cache.tree, engine.cache.host
        device = tree.peek(usable).depth if tree is not None else 0
        return max(device, host.peek(usable).depth if host is not None else 0)

    def _store_depth(self, usable: list[int]) -> int:
        if self.store is None:
            return 0
        best = 0
        for entry in self.store.entries():
            d = entry.depth
            if d > best and d <= len(usable) and tuple(usable[:d]) == entry.token_ids:
                best = d
        return best


def format_explanation(rows: Sequence[tuple[str, bool, dict[str, Any]]]) -> str:
    """(router, tiers, ``Explanation.as_dict()``) rows as a table of fractions of all prompt tokens."""
    head = f"{'router':<15}{'tiers':>6}{'oracle':>8}{'cached':>8}" + "".join(f"{c[:13]:>14}" for c in CAUSES)
    lines = ["computed prompt tokens by cause (fractions of all prompt tokens; tiers_explain.py):", head]
    for router, tiers, ex in rows:
        total = ex["prompt_tokens"] or 1
        fractions = ex["computed_fraction_by_cause"]
        lines.append(
            f"{router:<15}{'on' if tiers else 'off':>6}{ex['oracle_cached_fraction']:>8.3f}"
            f"{ex['cached_tokens'] / total:>8.3f}" + "".join(f"{fractions[c]:>14.3f}" for c in CAUSES)
        )
    return "\n".join(lines)
