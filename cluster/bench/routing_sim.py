"""Routing at scale: replay a workload over 8-32 simulated replicas with the real routers.

    python -m cluster.bench.routing_sim --replicas 8 16 32 --workload cache_pressure multi_turn

What is real and what is modelled:
- Real: our router's index (``cluster.routing.prefix_index.PrefixIndex``, fed the same
  ``CheckpointInserted`` / ``CheckpointEvicted`` events a replica publishes, after
  ``index_lag_s``) and its decision (``routing_policy.decide`` with the app's default
  ``RouterSettings``); Ray's ``PrefixTree`` (the pure class behind
  ``PrefixCacheAffinityRouter``'s tree actor) driven by that router's decision rule,
  restated in ``RayPrefixRouter``; the workload generators of ``workloads``.
- Modelled (``SimReplica``): each replica's hybrid cache is an LRU of Mamba checkpoints
  whose paths' KV pages must fit ``cache_tokens`` (a match is the deepest checkpoint at a
  page boundary, at most ``len(prompt) - 1``); checkpoints are written where the engine
  writes them (``workers/cache/checkpoints.py``): during prefill at ``((L - 1) // page) * page``
  and at the deepest grid point below it, at the branching point of a partial KV match,
  and at every chunk end that falls on the grid ``lcm(track_interval, page)`` (chunks of
  ``chunk_size`` cut at those targets); and at the last grid point a decode crosses.
  Time: a replica serves up to
  ``max_batch`` requests at once, each taking ``overhead + prefill_s * uncached prompt
  tokens + decode_s * output tokens``; the rest queue FIFO. A router's "load" is a
  replica's ongoing requests (what Serve's queue-length cache holds).

Multi-turn outputs are drawn deterministically (there is no model); turn k+1's prompt is
turn k's prompt + output + the next message, as in ``client``. Reported per router and
replica count: cached-token fraction (prompt tokens served from a checkpoint ÷ prompt
tokens), max/min requests per replica, and mean time to first token in the model.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.bench.client import arrival_times
from cluster.bench.sim_routers import PROPOSED, ROUTERS, Event, make_router
from cluster.bench.workloads import Session, Workload, load_workload
from cluster.routing.routing_policy import RouterSettings, max_usable_depth
from workers.cache.records import CheckpointEvicted, CheckpointInserted

__all__ = [
    "PROPOSED",
    "ROUTERS",
    "SimReplica",
    "SimResult",
    "SimSettings",
    "format_table",
    "run_grid",
    "scaled_workload",
    "simulate",
]


@dataclass(frozen=True)
class SimSettings:
    num_replicas: int = 8
    cache_tokens: int = 3072  # per replica (KV tokens the checkpoints' paths may use)
    page_size: int = 16
    track_interval: int = 256  # cache.mamba_track_interval
    chunk_size: int = 512  # scheduler.chunked_prefill_size
    max_batch: int = 8  # requests a replica serves at once
    overhead_s: float = 0.005
    prefill_s: float = 0.0002  # per uncached prompt token
    decode_s: float = 0.005  # per output token
    rate_per_replica: float = 30.0  # sessions per second per replica
    think_s: float = 0.5  # multi-turn: mean (exponential) pause before the next turn
    index_lag_s: float = 0.05  # replica event -> router index
    sessions_per_replica: int = 12  # multi-turn: chats per replica (~4k tokens > cache)
    seed: int = 0


# -- the modelled replica cache -----------------------------------------------------------------


class SimReplica:
    """An LRU of checkpoints whose paths' pages fit ``cache_tokens`` (see module doc)."""

    def __init__(self, s: SimSettings) -> None:
        self.s = s
        self._capacity_pages = max(s.cache_tokens // s.page_size, 1)
        self._page_refs: dict[int, int] = {}  # page key -> covering checkpoints
        self._ckpts: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # key -> path, LRU first

    def _keys(self, tokens: Sequence[int], depth: int) -> list[int]:
        """Chained keys of the first ``depth // page`` pages of ``tokens``."""
        keys, h, p = [], 0, self.s.page_size
        for i in range(depth // p):
            h = hash((h, tuple(tokens[i * p : (i + 1) * p])))
            keys.append(h)
        return keys

    def match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(deepest usable checkpoint depth, deepest cached KV depth) on ``tokens``'s path."""
        keys = self._keys(tokens, len(tokens))
        limit = max_usable_depth(len(tokens))
        hit = kv = 0
        for i, k in enumerate(keys, start=1):
            if k not in self._page_refs:
                break
            kv = i * self.s.page_size
            if k in self._ckpts and kv <= limit:
                hit = kv
        if hit:
            self._ckpts.move_to_end(keys[hit // self.s.page_size - 1])
        return hit, kv

    def insert(self, tokens: Sequence[int], depth: int) -> list[Event]:
        if depth <= 0:
            return []
        keys = self._keys(tokens, depth)
        key, path = keys[-1], tuple(tokens[:depth])
        if key in self._ckpts:
            self._ckpts.move_to_end(key)
            return []
        for k in keys:
            self._page_refs[k] = self._page_refs.get(k, 0) + 1
        self._ckpts[key] = path
        events: list[Event] = [CheckpointInserted(depth, b"", path)]
        while len(self._page_refs) > self._capacity_pages and len(self._ckpts) > 1:
            old_key, old_path = self._ckpts.popitem(last=False)
            for k in self._keys(old_path, len(old_path)):
                self._page_refs[k] -= 1
                if not self._page_refs[k]:
                    del self._page_refs[k]
            events.append(CheckpointEvicted(len(old_path), b"", old_path))
        return events

    def prefill_depths(self, tokens: Sequence[int], hit: int, kv: int) -> list[int]:
        """Targets (branching point, deepest grid point below the last reachable page, that
        page) and prefill chunk ends on the grid."""
        page, grid = self.s.page_size, self.grid
        last = ((len(tokens) - 1) // page) * page
        branch = kv if hit < kv < last else 0
        grid_below = (last // grid) * grid
        targets = sorted({d for d in (branch, grid_below if grid_below > hit else 0, last) if d > 0})
        depths, pos = set(targets), hit
        while pos < len(tokens):  # chunks end at chunk_size, a target or the prompt end
            end = min([pos + self.s.chunk_size, len(tokens)] + [t for t in targets if t > pos])
            if end % grid == 0:
                depths.add(end)
            pos = end
        return sorted(depths)

    @property
    def grid(self) -> int:
        return math.lcm(self.s.track_interval, self.s.page_size)

    def decode_depth(self, prompt_len: int, total_len: int) -> int:
        grid = self.grid
        deepest = ((total_len - 1) // grid) * grid
        return deepest if deepest > prompt_len else 0


# -- the event loop -------------------------------------------------------------------------------
@dataclass
class _Job:
    session: Session
    turn: int
    prompt: list[int]
    output: list[int]
    arrival: float
    replica: str = ""
    hit: int = 0


@dataclass
class SimResult:
    router: str
    workload: str
    num_replicas: int
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    cached_fraction: float
    requests_per_replica: dict[str, int] = field(default_factory=dict)
    load_max_min: float = 0.0
    mean_ttft_s: float = 0.0


class _Simulation:
    def __init__(self, workload: Workload, router_name: str, s: SimSettings) -> None:
        self.s, self.workload = s, workload
        self.names = [f"r{i:02d}" for i in range(s.num_replicas)]
        self.rng = random.Random(s.seed)
        self.router = make_router(router_name, self.names, self.rng, RouterSettings(replica_capacity=s.max_batch))
        self.replicas = {r: SimReplica(s) for r in self.names}
        self.ongoing = dict.fromkeys(self.names, 0)
        self.busy = dict.fromkeys(self.names, 0)
        self.queues: dict[str, deque[_Job]] = {r: deque() for r in self.names}
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = 0
        self.done: list[_Job] = []
        self.ttfts: list[float] = []

    def push(self, t: float, kind: str, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def run(self) -> list[_Job]:
        for warm in self.workload.warmup:  # unmeasured, one at a time, before t = 0
            self._serve_instantly(warm)
        rate = self.s.rate_per_replica * self.s.num_replicas
        for sess, t in zip(self.workload.sessions, arrival_times(len(self.workload.sessions), rate, seed=self.s.seed)):
            self.push(t, "arrive", self._job(sess, 0, list(sess.shared_ids), t))
        while self._heap:
            t, _, kind, payload = heapq.heappop(self._heap)
            getattr(self, f"_on_{kind}")(t, payload)
        return self.done

    def _job(self, sess: Session, turn: int, history: list[int], t: float) -> _Job:
        prompt = history + list(sess.turns[turn].user_ids)
        rng = random.Random(self.s.seed * 1_000_003 + sess.session_id * 1009 + turn)
        output = [rng.randrange(16, 500) for _ in range(sess.turns[turn].max_tokens)]
        return _Job(sess, turn, prompt, output, t)

    def _serve_instantly(self, sess: Session) -> None:
        job = self._job(sess, 0, list(sess.shared_ids), -1.0)
        job.replica = self.router.choose(job.prompt, dict(self.ongoing), -1.0)
        self.router.on_routed(job.prompt, job.replica, -1.0)
        cache = self.replicas[job.replica]
        hit, kv = cache.match(job.prompt)
        for d in cache.prefill_depths(job.prompt, hit, kv):
            self.router.on_events(job.replica, cache.insert(job.prompt, d))

    def _on_arrive(self, t: float, job: _Job) -> None:
        job.replica = self.router.choose(job.prompt, dict(self.ongoing), t)
        self.router.on_routed(job.prompt, job.replica, t)
        self.ongoing[job.replica] += 1
        self.queues[job.replica].append(job)
        self._start_next(t, job.replica)

    def _start_next(self, t: float, r: str) -> None:
        while self.busy[r] < self.s.max_batch and self.queues[r]:
            job = self.queues[r].popleft()
            self.busy[r] += 1
            cache = self.replicas[r]
            job.hit, kv = cache.match(job.prompt)
            prefill_end = t + self.s.overhead_s + self.s.prefill_s * (len(job.prompt) - job.hit)
            self.ttfts.append(prefill_end - job.arrival)
            self.push(prefill_end, "prefilled", (job, kv))
            self.push(prefill_end + self.s.decode_s * len(job.output), "finish", job)

    def _publish(self, t: float, r: str, events: list[Event]) -> None:
        if events:
            self.push(t + self.s.index_lag_s, "events", (r, events))

    def _on_events(self, t: float, payload: tuple[str, list[Event]]) -> None:
        self.router.on_events(*payload)

    def _on_prefilled(self, t: float, payload: tuple[_Job, int]) -> None:
        job, kv = payload
        cache = self.replicas[job.replica]
        for d in cache.prefill_depths(job.prompt, job.hit, kv):
            self._publish(t, job.replica, cache.insert(job.prompt, d))

    def _on_finish(self, t: float, job: _Job) -> None:
        r = job.replica
        cache = self.replicas[r]
        full = job.prompt + job.output
        self._publish(t, r, cache.insert(full, cache.decode_depth(len(job.prompt), len(full))))
        self.busy[r] -= 1
        self.ongoing[r] -= 1
        self.done.append(job)
        if job.turn + 1 < len(job.session.turns):
            think = random.Random(self.s.seed * 7919 + job.session.session_id * 31 + job.turn)
            nxt = self._job(job.session, job.turn + 1, full, t + think.expovariate(1 / self.s.think_s))
            self.push(nxt.arrival, "arrive", nxt)
        self._start_next(t, r)


def simulate(workload: Workload, router: str, settings: SimSettings) -> SimResult:
    sim = _Simulation(workload, router, settings)
    done = sim.run()
    prompt = sum(len(j.prompt) for j in done)
    cached = sum(j.hit for j in done)
    per = {r: 0 for r in sim.names}
    for j in done:
        per[j.replica] += 1
    low = min(per.values())
    return SimResult(
        router,
        workload.name,
        settings.num_replicas,
        len(done),
        prompt,
        cached,
        round(cached / prompt, 4) if prompt else 0.0,
        per,
        round(max(per.values()) / low, 3) if low else float("inf"),
        round(sum(sim.ttfts) / len(sim.ttfts), 4) if sim.ttfts else 0.0,
    )


def scaled_workload(name: str, settings: SimSettings, overrides: dict[str, Any] | None = None) -> Workload:
    """The named workload sized for ``settings.num_replicas`` replicas: cache pressure fills
    its fraction of the cluster cache; multi-turn gets 4 sessions per replica."""
    extra: dict[str, Any] = dict(overrides or {})
    if name == "cache_pressure":
        extra.setdefault("cluster_cache_tokens", settings.cache_tokens * settings.num_replicas)
    elif name == "multi_turn":
        extra.setdefault("num_sessions", settings.sessions_per_replica * settings.num_replicas)
    return load_workload(name, extra)


def run_grid(
    workloads: Sequence[str],
    replicas: Sequence[int],
    routers: Sequence[str] = ROUTERS,
    base: SimSettings = SimSettings(),
    overrides: dict[str, dict[str, Any]] | None = None,
) -> list[SimResult]:
    results = []
    for name in workloads:
        for n in replicas:
            s = SimSettings(**{**asdict(base), "num_replicas": n})
            w = scaled_workload(name, s, (overrides or {}).get(name))
            results.extend(simulate(w, r, s) for r in routers)
    return results


def format_table(results: Sequence[SimResult]) -> str:
    lines = [
        f"{'workload':<16}{'replicas':>9}{'router':>17}{'cached':>9}{'vs rr':>8}{'load max/min':>14}{'ttft ms':>9}"
    ]
    rr = {(r.workload, r.num_replicas): r.cached_fraction for r in results if r.router == "round_robin"}
    for r in results:
        base = rr.get((r.workload, r.num_replicas))
        ratio = f"{r.cached_fraction / base:.2f}" if base else "-"
        lines.append(
            f"{r.workload:<16}{r.num_replicas:>9}{r.router:>17}{r.cached_fraction:>9.3f}{ratio:>8}"
            f"{r.load_max_min:>14.2f}{1000 * r.mean_ttft_s:>9.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--workload", nargs="+", default=["cache_pressure", "multi_turn"])
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS + PROPOSED))
    ap.add_argument("--chunk-size", type=int, default=SimSettings.chunk_size)
    ap.add_argument("--track-interval", type=int, default=SimSettings.track_interval)
    ap.add_argument("--cache-tokens", type=int, default=SimSettings.cache_tokens, help="per replica")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = ap.parse_args(argv)
    base = SimSettings(cache_tokens=args.cache_tokens, track_interval=args.track_interval, chunk_size=args.chunk_size)
    results = run_grid(args.workload, args.replicas, args.routers, base)
    if args.json:
        for r in results:
            print(json.dumps(asdict(r)))
    else:
        print(format_table(results))


if __name__ == "__main__":
    main()
