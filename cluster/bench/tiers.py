"""The tiers' measurements with real engines in one process: tiers on vs device only, and
our router against Ray's ``PrefixCacheAffinityRouter`` rule and round robin.

    python -m cluster.bench.tiers [--replicas 4] [--sessions 32] [--routers ...] [--json]
                                  [--explain] [--host-factor 4] [--store-factor 4] [--tiers-only]
    python -m cluster.bench.tiers --multi-turn        # the 20-conversation turn-2 case only

``slot_pressure`` (agentic sessions whose contexts grow by tool outputs) over
``--replicas`` engines on the tiny model, each sized with Qwen3-Next's slot-to-KV ratio
(``slot_kv_tokens``: one recurrent-state slot weighs ~3,000 tokens of KV, so a replica of
24k KV tokens holds 8 slots, its running requests' included), with more live sessions than
the cluster holds device checkpoints. ``tiers`` adds a host tier of ``host_factor`` times
the device budget per replica and a cluster store (``LocalStoreBackend``: the same client
and cost model as on Ray, without the network; sized and costed at Qwen3-Next's
proportions, ``ClusterSettings.store_model``; the router credits the store from the cost
model's break-even on, ``fetch_break_even_tokens``). Routers are the ones ``routing_sim``
drives: ours over the real tiered index fed the engines' real events (device, host,
store), Ray's rule over Ray's own ``PrefixTree``, round robin.

What is real: engines, caches, tiers, store client, routers. What is not: the network
(replicas are stepped round robin in this process, sessions arrive every ``arrival_steps``
steps and think ``think_steps`` steps between turns). Reported per (router, tiers):
computed prefill fraction and cached fraction (counts: valid on a loaded machine), and
mean TTFT in global steps (deterministic) and in seconds (needs an idle machine), and
``explain``: the computed prompt tokens by cause and the oracle (``tiers_explain.py``), and
``split``: TTFT as queue wait + prefill, in steps and modelled seconds (``tiers_ttft.py``).
The defaults overload the cluster; ``--below-capacity`` (``ClusterSettings.below_capacity``)
is the operating point of a serving benchmark, where TTFT is not the queue's length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from cluster.bench.sim_routers import make_router
from cluster.bench.tiers_explain import Explainer, format_explanation  # noqa: F401 - re-exported
from cluster.bench.tiers_multi_turn import multi_turn_case  # noqa: F401 - re-exported
from cluster.bench.tiers_settings import ROUTERS, ClusterSettings
from cluster.bench.tiers_ttft import StepCost, StepLog, fit_step_cost, format_split, ttft_split
from cluster.bench.workloads import Session, load_workload
from cluster.routing.routing_policy import RouterSettings
from cluster.store.checkpoint_store import CheckpointStore, CommitResult, StoreEntry
from cluster.store.client import FetchSettings, LocalStoreBackend, StoreClient
from workers.llm import LLM
from workers.sampling.params import SamplingParams
from workers.tiers.payload import CheckpointPayload


@dataclass
class TiersResult:
    router: str
    tiers: bool
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    computed_fraction: float
    cached_fraction: float
    mean_ttft_steps: float
    mean_ttft_s: float
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    store: dict[str, int] = field(default_factory=dict)
    explain: dict[str, Any] = field(default_factory=dict)  # tiers_explain.Explanation.as_dict
    split: dict[str, float] = field(default_factory=dict)  # tiers_ttft.ttft_split: queue vs prefill


class _Direct:
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def run(self, fn: Any) -> Any:
        return fn(self.engine)


def fetch_break_even_tokens(nbytes: int, fetch: FetchSettings) -> int:
    """The fewest tokens whose prefill a fetch of ``nbytes`` beats under ``fetch``'s fixed
    throughputs (``FetchCost.should_fetch``): the router's ``store_min_gain_tokens``, so
    that it credits the store only where the replica would fetch (``nbytes``: a slot at
    the modelled weight; a path's KV adds a little, so long paths are credited early)."""
    fetch_s = fetch.latency_s + nbytes / fetch.bandwidth_bytes_per_s
    return math.ceil(fetch_s * fetch.prefill_tokens_per_s / (1.0 - fetch.margin))


class _ModelledStore(LocalStoreBackend):
    """The in-process store, charging each entry ``slot_extra`` bytes on top of its payload
    (its slot at the modelled weight, ``ClusterSettings.store_model``)."""

    def __init__(self, store: CheckpointStore, slot_extra: int) -> None:
        super().__init__(store)
        self.slot_extra = slot_extra

    async def commit(self, payload: CheckpointPayload, owner: str) -> CommitResult:
        return self.store.commit(
            StoreEntry(
                payload.prefix_hash, payload.depth, payload.token_ids, payload.nbytes + self.slot_extra, payload, owner
            )
        )


@dataclass
class _Live:
    session: Session
    turn: int
    prompt: list[int]
    replica: str
    step: int
    wall: float
    first_step: int | None = None
    first_wall: float | None = None
    output: list[int] = field(default_factory=list)  # its tokens so far


class _Cluster:
    def __init__(
        self,
        model: Path,
        s: ClusterSettings,
        tiers: bool,
        router: str,
        cost: StepCost = StepCost(),
        calibrate: bool = False,
    ) -> None:
        self.s, self.tiers = s, tiers
        self.names = [f"r{i}" for i in range(s.num_replicas)]
        self.llms = {n: LLM(**s.engine(model, tiers)) for n in self.names}
        for llm in self.llms.values():
            llm.engine.record_cache_events()  # the router index is fed them (``_publish``)
        self.logs = {n: StepLog(llm.engine, cost, calibrate) for n, llm in self.llms.items()}
        self.store: CheckpointStore | None = None
        self.clients: dict[str, StoreClient] = {}
        settings = RouterSettings(
            load_penalty_tokens=s.load_penalty_tokens,
            load_penalty_auto=s.load_penalty_auto,
            replica_capacity=s.max_running,
        )
        if tiers and s.store_factor > 0:
            storage = self.llms[self.names[0]].engine.cache.host.storage
            budget, extra, fetch = s.store_model(storage.nbytes(0, 1) // s.page_size, storage.nbytes(1, 0))
            backend = _ModelledStore(CheckpointStore(budget), extra)
            self.store = backend.store
            self.clients = {n: StoreClient(backend, s.page_size, n, fetch) for n in self.names}
            gain = fetch_break_even_tokens(extra + storage.nbytes(1, 0), fetch)
            settings = replace(settings, store_min_gain_tokens=gain)
        self.router = make_router(router, self.names, random.Random(s.seed), settings)
        self.explainer = Explainer({n: llm.engine for n, llm in self.llms.items()}, self.store, s.page_size)
        self.step_no = 0

    def _submit(self, rid: str, live: _Live) -> None:
        engine = self.llms[live.replica].engine
        if self.clients:
            outcome = asyncio.run(self.clients[live.replica].prefetch(_Direct(engine), live.prompt))
            self.explainer.on_fetch(rid, outcome)
        params = SamplingParams(max_tokens=live.session.turns[live.turn].max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(rid, live.prompt, params)

    def run(self, sessions: Sequence[Session]) -> list[tuple[_Live, Any]]:
        due: list[tuple[int, int, Session, int, list[int]]] = [
            (i * self.s.arrival_steps, i, sess, 0, list(sess.shared_ids)) for i, sess in enumerate(sessions)
        ]
        live: dict[str, _Live] = {}
        done: list[tuple[_Live, Any]] = []
        while due or live:
            due.sort(key=lambda d: (d[0], d[1]))
            while due and due[0][0] <= self.step_no:
                _, i, sess, turn, history = due.pop(0)
                prompt = history + list(sess.turns[turn].user_ids)
                loads = {n: sum(v.replica == n for v in live.values()) for n in self.names}
                replica = self.router.choose(prompt, loads, float(self.step_no))
                self.router.on_routed(prompt, replica, float(self.step_no))
                rid = f"s{sess.session_id}-t{turn}"
                previous = len(history) - sess.turns[turn - 1].max_tokens if turn else 0
                self.explainer.on_route(rid, prompt, replica, len(sess.shared_ids), previous)
                live[rid] = _Live(sess, turn, prompt, replica, self.step_no, time.perf_counter())
                self.logs[replica].on_arrival(rid, self.step_no)
                self._submit(rid, live[rid])
            self.step_no += 1
            for name, llm in self.llms.items():
                if llm.engine.has_unfinished():
                    self._step(name, llm, live, done, due)
                self._publish(name, llm)
        return done

    def _step(self, name: str, llm: LLM, live: dict[str, _Live], done: list, due: list) -> None:
        outs = llm.engine.step()
        self.logs[name].after_step(self.step_no)
        for out in outs:
            item = live.get(out.request_id)
            if item is None:
                continue
            item.output += out.new_token_ids
            if item.first_step is None and out.new_token_ids:
                item.first_step, item.first_wall = self.step_no, time.perf_counter()
                self.logs[name].on_first_token(out.request_id, self.step_no)
                self.explainer.on_prefilled(item.prompt)
            if out.finished:
                del live[out.request_id]
                done.append((item, out))
                self.explainer.on_done(out.request_id, item.prompt + item.output, out.cached_tokens)
                if item.turn + 1 < len(item.session.turns):
                    history = item.prompt + item.output
                    due.append(
                        (
                            self.step_no + self.s.think_steps,
                            item.session.session_id,
                            item.session,
                            item.turn + 1,
                            history,
                        )
                    )

    def _publish(self, name: str, llm: LLM) -> None:
        events = llm.engine.drain_cache_events()
        if self.clients:
            events += asyncio.run(self.clients[name].commit_pending(_Direct(llm.engine)))
        if events:
            self.router.on_events(name, events)
            self.explainer.on_events(events)


def run_one(
    model: Path,
    sessions: Sequence[Session],
    router: str,
    tiers: bool,
    s: ClusterSettings = ClusterSettings(),
    cost: StepCost = StepCost(),
    samples: list[tuple[int, int, float]] | None = None,
) -> TiersResult:
    """One run; ``samples`` (if given) collects every step's (computed, rows, seconds)."""
    cluster = _Cluster(model, s, tiers, router, cost, calibrate=samples is not None)
    done = cluster.run(sessions)
    if samples is not None:
        samples.extend(x for log in cluster.logs.values() for x in log.samples)
    prompt = sum(len(item.prompt) for item, _ in done)
    cached = sum(out.cached_tokens for _, out in done)
    ttft_steps = [item.first_step - item.step for item, _ in done if item.first_step is not None]
    ttft_s = [item.first_wall - item.wall for item, _ in done if item.first_wall is not None]
    hits: dict[str, int] = {}
    for llm in cluster.llms.values():
        for tier, n in llm.stats()["hybridserve_cache_hits_total"].items():
            hits[tier] = hits.get(tier, 0) + n
    store = cluster.store.stats() if cluster.store else {}
    return TiersResult(
        router,
        tiers,
        len(done),
        prompt,
        cached,
        round(1 - cached / prompt, 4),
        round(cached / prompt, 4),
        round(sum(ttft_steps) / len(ttft_steps), 2),
        round(sum(ttft_s) / len(ttft_s), 4),
        hits,
        {k: int(v) for k, v in store.items()},
        cluster.explainer.result.as_dict(),
        ttft_split(cluster.logs.values()),
    )


def goals(results: Sequence[TiersResult]) -> dict[str, float | None]:
    """The issue's ratios: tiers vs device only (ours), ours vs Ray's rule (tiers on)."""
    by = {(r.router, r.tiers): r for r in results}
    ours, device = by.get(("hybrid_prefix", True)), by.get(("hybrid_prefix", False))
    ray = by.get(("ray_prefix", True))

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {
        "computed_prefill_tiers_over_device": ratio(
            ours and ours.computed_fraction, device and device.computed_fraction
        ),
        "ttft_steps_tiers_over_device": ratio(ours and ours.mean_ttft_steps, device and device.mean_ttft_steps),
        "ttft_s_tiers_over_device": ratio(ours and ours.mean_ttft_s, device and device.mean_ttft_s),
        "ttft_model_s_tiers_over_device": ratio(
            ours and ours.split["ttft_model_s"], device and device.split["ttft_model_s"]
        ),
        "cached_vs_ray": ratio(ours and ours.cached_fraction, ray and ray.cached_fraction),
    }


def format_table(results: Sequence[TiersResult]) -> str:
    lines = [
        f"{'router':<15}{'tiers':>6}{'requests':>9}{'computed':>10}{'cached':>8}{'ttft steps':>11}"
        f"{'ttft s':>8}  hits by tier"
    ]
    for r in results:
        lines.append(
            f"{r.router:<15}{'on' if r.tiers else 'off':>6}{r.num_requests:>9}"
            f"{r.computed_fraction:>10.3f}{r.cached_fraction:>8.3f}{r.mean_ttft_steps:>11.2f}"
            f"{r.mean_ttft_s:>8.3f}  {r.hits_by_tier}"
        )
    return "\n".join(lines)


def _arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: a random tiny Qwen3-Next")
    ap.add_argument("--replicas", type=int, default=ClusterSettings.num_replicas)
    ap.add_argument("--sessions", type=int, default=None, help="override the workload's num_sessions")
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--toolsets", type=int, default=None, help="override num_toolsets (system prompts)")
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS))
    ap.add_argument("--host-factor", type=int, default=ClusterSettings.host_factor, help="host tier, device budgets")
    ap.add_argument(
        "--store-factor",
        type=float,
        default=ClusterSettings.store_factor,
        help="cluster store, in replica device budgets (0: no store)",
    )
    ap.add_argument(
        "--think-steps",
        type=int,
        default=ClusterSettings.think_steps,
        help="steps between a turn's answer and the next turn (the tool call)",
    )
    ap.add_argument(
        "--arrival-steps",
        type=float,
        default=ClusterSettings.arrival_steps,
        help="steps between two sessions' first turns",
    )
    ap.add_argument(
        "--policy",
        choices=("fcfs", "lpm"),
        default=ClusterSettings.policy,
        help="the replicas' scheduler.policy (waiting-queue order)",
    )
    ap.add_argument(
        "--load-penalty-tokens",
        type=float,
        default=ClusterSettings.load_penalty_tokens,
        help="our router's RouterSettings.load_penalty_tokens (the floor of the learnt penalty)",
    )
    ap.add_argument(
        "--fixed-load-penalty",
        action="store_true",
        help="RouterSettings.load_penalty_auto off: the penalty is --load-penalty-tokens",
    )
    ap.add_argument(
        "--below-capacity",
        action="store_true",
        help="ClusterSettings.below_capacity(): think 60, sessions every 6 steps",
    )
    ap.add_argument("--tiers-only", action="store_true", help="skip the device-only runs")
    ap.add_argument("--multi-turn", action="store_true", help="only the 20-conversation turn-2 case")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--explain", action="store_true", help="computed prompt tokens by cause (tiers_explain.py)")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="fit the modelled step cost (tiers_ttft.StepCost) to this machine's step times, then use it",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    import os
    import tempfile

    from tools.tiny import make_tiny_checkpoint

    args = _arg_parser().parse_args(argv)
    model = args.model or make_tiny_checkpoint("qwen3_next", Path(tempfile.mkdtemp()) / "m", seed=0)
    if args.multi_turn:
        for strategy in ("extra_buffer", "extra_buffer_lazy"):
            for host in (False, True):
                print(json.dumps(multi_turn_case(model, strategy, host)))
        return
    overrides = {
        k: v
        for k, v in (("num_sessions", args.sessions), ("num_turns", args.turns), ("num_toolsets", args.toolsets))
        if v
    }
    sessions = load_workload("slot_pressure", overrides).sessions
    s = ClusterSettings(
        num_replicas=args.replicas,
        host_factor=args.host_factor,
        store_factor=args.store_factor,
        think_steps=args.think_steps,
        arrival_steps=args.arrival_steps,
        policy=args.policy,
        load_penalty_tokens=args.load_penalty_tokens,
        load_penalty_auto=not args.fixed_load_penalty,
    )
    if args.below_capacity:
        s = s.below_capacity()
    modes = (True,) if args.tiers_only else (False, True)
    cost = StepCost()
    if args.calibrate:
        samples: list[tuple[int, int, float]] = []
        for t in modes:
            run_one(model, sessions, args.routers[0], t, s, cost, samples)
        cost = fit_step_cost(samples)
        print(json.dumps({"calibrated_step_cost": asdict(cost), "steps": len(samples)}))
    results = [run_one(model, sessions, r, t, s, cost) for r in args.routers for t in modes]
    if args.json:
        for r in results:
            print(json.dumps(asdict(r)))
    else:
        print(format_table(results))
        print(format_split([(r.router, r.tiers, r.split) for r in results], cost))
    if args.explain:
        print(format_explanation([(r.router, r.tiers, r.explain) for r in results]))
    print(json.dumps({**goals(results), "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
