"""The differential fuzz: random engine configurations and workloads against a reference,
with liveness and state oracles, on the toy model (exact, fast) and on a real tiny model.

A case draws the prefix cache on or off, a strategy, page size, track interval, MTP drafts
(0-4), overlap, chunk and budget, concurrency, the waiting queue's policy (``fcfs`` or
``lpm`` with a bypass bound), KV and Mamba pool sizes (down to a KV pool that holds the
longest request alone and a single Mamba slot), forced pending-allocation failures, stop tokens,
aborts (half of them retried at once under the same request id), an acceptance script
(toy), and the host tier (``cache.host_mamba_slots`` 1-64 and ``host_kv_tokens`` from half
the longest request up; forced transfer failures ``debug.fail_transfer_prob`` 0 / 0.3 / 1):
small pools then demote and promote all the time. Its workload shares system prompts whose lengths sit
at the checkpoint grid and page boundaries +- 1, and runs three rounds: the prompts, the
same prompts newest first, and follow-up turns (prompt + part of its output + a new token).

Oracles, per request and per step:
- differential: every output equals the reference -- the toy model's analytic greedy
  continuation, or the real model with prefix cache, speculation and overlap all off --
  cut at the context limit (an aborted request: a prefix of it);
- invariants: ``engine.check_invariants()`` after every step (counted by invariant);
- state: toy -- every tree node's slot holds exactly H(path) (``Sim`` checks every node
  after every step, host tree included); real -- ``debug.state_oracle_sample=1``
  recomputes every published checkpoint by a fresh prefill (promoted ones included);
- liveness: every round finishes within ``step_bound`` steps (a request that fits the pools
  alone always finishes; see its docstring).

``python -m tests.sim.fuzz --toy 400 --real 40 [--guard-off] [--tiers]`` prints the counts;
the test files run short versions (and the long ones under ``slow``).
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from configs.schema import load_config
from tests.sim.harness import Sim, TokenLog
from tests.sim.toy import chain
from workers.engine import Engine
from workers.sampling.params import SamplingParams


class Livelock(AssertionError):
    """A round did not finish within its step bound."""


def step_bound(lengths: list[int], page_size: int, num_draft_tokens: int) -> int:
    """Steps within which a round of requests of ``lengths`` (prompt + max_tokens) ends.

    The oldest unfinished request is never preempted, so it advances by at least one token
    every 2 steps (a verify or a checkpoint write in flight makes it skip one), is stalled
    at most one step per page it grows by (draining an in-flight victim), and recomputes
    its tokens at most once after it became the oldest. Summed over the requests in age
    order, with slack for admission waits: 4 * sum(2 L + L / page + k + 2) + 16.
    """
    return 4 * sum(2 * n + n // page_size + num_draft_tokens + 2 for n in lengths) + 16


@dataclass(frozen=True)
class Case:
    seed: int
    overrides: dict[str, Any]
    grid: int
    page: int
    num_drafts: int
    max_tokens: int
    stop_prob: float
    abort_prob: float
    script_kind: str
    base_lengths: tuple[int, ...]

    def script(self, request_id: str, position: int, first: bool, k: int) -> int:
        if self.script_kind == "none":
            return 0
        if self.script_kind == "all":
            return k
        salt = chain([position, self.seed], chain(request_id.encode())).digest % (k + 1)
        return k if first and self.script_kind == "first_all" else salt


def draw(seed: int, guard_off: bool = False, tiers: bool = False) -> Case:
    """One case. ``tiers``: always the prefix cache with the host tier, and a device slot
    pool with room for checkpoints (at least one beyond the running requests' live slots),
    so that evictions demote and later rounds promote; the other fields as drawn."""
    rng = random.Random(seed)
    strategy = rng.choice(["extra_buffer", "extra_buffer_lazy", "extra_buffer_lazy", "no_buffer"])
    page = rng.choice([1, 1, 2, 4] if strategy == "no_buffer" else [1, 1, 2, 4, 8, 16])
    interval = rng.choice([4, 8, 16, 32])
    grid = math.lcm(interval, page)
    k = rng.choice([0, 1, 2, 3, 4])
    chunk = rng.choice([1, 3, 5, 8, 16, 64])
    max_running = rng.choice([1, 2, 3, 4, 6])
    per_request = {"no_buffer": 1, "extra_buffer": 3, "extra_buffer_lazy": 2}[strategy]
    slots = rng.choice([1, max_running, max_running * per_request, max_running * per_request + rng.choice([1, 4, 12])])
    max_tokens = rng.choice([1, 2, 5, 9, 17, 32])
    near = [grid - 1, grid, grid + 1, 2 * grid - 1, 2 * grid + 1, page + 1, max(1, page - 1)]
    spread = rng.choice([40, 40, 80])  # 80: long prompts that crowd a tight pool
    bases = tuple(rng.choice(near) if rng.random() < 0.7 else rng.randrange(1, spread) for _ in range(4))
    longest = max(bases) + 20 + max_tokens + k + 2  # prompt tail <= 19, follow-up + 1
    tight = (-(-longest // page) + 1) * page  # the longest request fits alone
    # Smaller pools cap the context (max_model_len) instead: every request still fits alone,
    # cut at the limit as its reference is, and several long ones crowd the pool.
    kv = max(rng.choice([tight // 3, tight // 2, tight, 2 * tight, 16384]), 3 * page + k + 2)
    overrides = {
        "cache": {
            "enable_prefix_cache": rng.random() < 0.85,
            "mamba_strategy": strategy,
            "page_size": page,
            "mamba_track_interval": interval,
            "max_mamba_slots": slots,
            "max_kv_tokens": kv,
        },
        "scheduler": {
            "overlap": rng.random() < 0.8,
            "max_running_requests": max_running,
            "chunked_prefill_size": chunk,
            "max_batch_tokens": max(chunk, rng.choice([chunk, 32, 512])),
        },
        "spec": {"method": "mtp" if k else "none", "num_draft_tokens": max(k, 1)},
        "debug": {"fail_pending_alloc_prob": rng.choice([0.0, 0.0, 0.3, 1.0]), "disable_alias_guard": guard_off},
    }
    case = Case(
        seed,
        overrides,
        grid,
        page,
        k,
        max_tokens,
        rng.choice([0.0, 0.3]),
        rng.choice([0.0, 0.0, 0.05]),
        rng.choice(["first_all", "salted", "none", "all"]),
        bases,
    )
    # Drawn last, so that every field above stays what it was for a seed (LIVELOCK_SEEDS).
    cache = overrides["cache"]
    host = rng.random() < 0.6
    if tiers:
        cache["enable_prefix_cache"] = host = True
        cache["max_mamba_slots"] = max(slots, max_running + 1)
    if cache["enable_prefix_cache"] and host:
        cache["host_mamba_slots"] = rng.choice([1, 2, 4, 16, 64])
        cache["host_kv_tokens"] = max(page, rng.choice([tight // 2, tight, 4 * tight, 16384]))
        overrides["debug"]["fail_transfer_prob"] = rng.choice([0.0, 0.0, 0.2, 0.5, 1.0])
    if rng.random() < 0.5:  # the waiting queue's order (drawn last, for the same reason)
        overrides["scheduler"].update(policy="lpm", lpm_max_bypass=rng.choice([0, 1, 4, 8]))
    return case


@dataclass
class Tally:
    """What a fuzz run found (summed over cases)."""

    configs: int = 0
    requests: int = 0
    divergences: int = 0
    violations: Counter = field(default_factory=Counter)
    state_checks: int = 0
    state_mismatches: int = 0
    livelocks: int = 0
    crashes: int = 0
    hits: int = 0
    preemptions: int = 0
    steps: int = 0
    tiered: int = 0  # configurations with the host tier on
    demotions: int = 0  # checkpoints copied device -> host
    promotions: int = 0  # ... and host -> device
    transfer_failures: int = 0  # forced copy failures (both directions)
    examples: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        for name in (
            "configs",
            "requests",
            "divergences",
            "state_checks",
            "state_mismatches",
            "livelocks",
            "crashes",
            "hits",
            "preemptions",
            "steps",
            "tiered",
            "demotions",
            "promotions",
            "transfer_failures",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.violations.update(other.violations)
        self.examples += other.examples[: max(0, 5 - len(self.examples))]

    @property
    def clean(self) -> bool:
        return not (self.divergences or self.violations or self.state_mismatches or self.livelocks or self.crashes)


# -- targets ------------------------------------------------------------------------------------
class ToyTarget:
    """The engine over the toy model: exact reference and exact state oracle."""

    def __init__(self, model_dir, case: Case) -> None:
        self.sim = Sim(model_dir, case.overrides, script=case.script)
        self.engine = self.sim.engine
        self.low, self.high = self.sim.vocab.low, self.sim.vocab.high

    def step(self):
        return self.sim.step()

    def abort(self, request_id: str):
        return self.sim.abort(request_id)

    def reference(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [self.sim.vocab.greedy(p, max_tokens) for p in prompts]

    def tally(self, t: Tally) -> None:
        o = self.sim.oracles
        t.violations.update(o.violations)
        t.state_checks += o.node_checks
        t.state_mismatches += o.num_aliased + len(self.sim.runner.corruptions)

    def close(self) -> None:
        self.sim.close()


class RealTarget:
    """The engine on a real tiny checkpoint; reference: an all-off engine (``Control``)."""

    def __init__(self, model_dir, case: Case, control: Control) -> None:
        debug = {**case.overrides["debug"], "check_invariants": True, "state_oracle_sample": 1.0}
        config = load_config(
            overrides={"model": str(model_dir), "device": "cpu", "dtype": "float32", **case.overrides, "debug": debug}
        )
        self.engine = Engine(config)
        self.control = control
        self.low, self.high = 3, self.engine.vocab_size - 8
        self.log = TokenLog()

    def step(self):
        return self.log.feed(self.engine.step())

    def abort(self, request_id: str):
        done = self.log.feed([self.engine.abort(request_id)])
        return done[0] if done else None

    def reference(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self.control.greedy(prompts, max_tokens)

    def tally(self, t: Tally) -> None:
        s = self.engine.stats.snapshot()
        t.violations.update(s["hybridserve_invariant_violations_total"])
        t.state_checks += s["hybridserve_state_oracle_checks_total"]
        t.state_mismatches += s["hybridserve_state_oracle_mismatches_total"]

    def close(self) -> None:
        self.engine.runner.shutdown()


class Control:
    """Greedy outputs of the reference engine (every variant off), memoised per prompt."""

    def __init__(self, model_dir) -> None:
        from workers.llm import LLM

        self.llm = LLM(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            cache={"enable_prefix_cache": False, "max_kv_tokens": 16384},
            scheduler={"overlap": False},
        )
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        todo = [p for p in prompts if (tuple(p), max_tokens) not in self._memo]
        if todo:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for p, out in zip(todo, self.llm.generate_ids(todo, [params] * len(todo))):
                self._memo[(tuple(p), max_tokens)] = out.token_ids
        return [self._memo[(tuple(p), max_tokens)] for p in prompts]


# -- running ------------------------------------------------------------------------------------
def workload(case: Case, rng: random.Random, low: int, high: int, limit: int) -> list[list[int]]:
    """Prompts over four system prompts of the case's lengths (grid / page +- 1)."""
    bases = [[rng.randrange(low, high) for _ in range(n)] for n in case.base_lengths]
    prompts = []
    for _ in range(rng.randrange(6, 14)):
        base = rng.choice(bases)
        cut = len(base) if rng.random() < 0.5 else rng.randrange(0, len(base) + 1)
        tail = [rng.randrange(low, high) for _ in range(rng.randrange(1, 20))]
        prompts.append((base[:cut] + tail)[: limit - 2])
    return prompts


def run_round(target, case: Case, rng: random.Random, prompts: list[list[int]], t: Tally) -> None:
    e = target.engine
    limit = e.max_model_len
    wants, params = [], []
    for p, ref in zip(prompts, target.reference(prompts, case.max_tokens)):
        want = ref[: limit - len(p)]
        stop = ()
        if len(want) > 1 and rng.random() < case.stop_prob:
            stop = (want[rng.randrange(len(want))],)
            want = want[: want.index(stop[0]) + 1]
        params.append(SamplingParams(max_tokens=case.max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop))
        wants.append(want)
    ids = [f"fuzz-{t.requests + i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        e.add_request(rid, p, sp)
    t.requests += len(prompts)
    outs: dict[str, Any] = {}
    aborted: set[str] = set()
    bound = step_bound([len(p) + case.max_tokens for p in prompts], case.page, case.num_drafts)
    for _ in range(bound):
        if not e.has_unfinished():
            break
        t.steps += 1
        for i, rid in enumerate(ids):
            if case.abort_prob and rid in e.requests and rng.random() < case.abort_prob:
                out = target.abort(rid)
                if out is None:
                    continue
                if rng.random() < 0.5:  # a client retry under the same id, at once
                    e.add_request(rid, prompts[i], params[i])
                    continue
                outs[rid] = out
                aborted.add(rid)
        for out in target.step():
            if out.finished and out.request_id not in outs:
                outs[out.request_id] = out
    if e.has_unfinished():
        raise Livelock(f"case {case.seed}: not finished within {bound} steps")
    for rid, want in zip(ids, wants):
        got = outs[rid].token_ids
        if not (got == want[: len(got)] if rid in aborted else got == want):
            t.divergences += 1
            t.examples.append(f"case {case.seed} {rid}: {got} != {want}")


def run_case(target, case: Case) -> Tally:
    """Three rounds on one engine; the tally of what the oracles found."""
    t = Tally(configs=1)
    rng = random.Random(case.seed + 1)
    limit = target.engine.max_model_len
    prompts = workload(case, rng, target.low, target.high, limit)
    try:
        run_round(target, case, rng, prompts, t)
        run_round(target, case, rng, prompts[::-1], t)
        refs = target.reference(prompts, case.max_tokens)
        # A follow-up turn carries all of the previous output (as chat does) or a part of it.
        cuts = [len(r) if rng.random() < 0.5 else rng.randrange(0, len(r) + 1) for r in refs]
        follow = [
            (p + r[:n] + [rng.randrange(target.low, target.high)])[: limit - 2] for p, r, n in zip(prompts, refs, cuts)
        ]
        run_round(target, case, rng, follow, t)
    except Livelock as exc:
        t.livelocks += 1
        t.examples.append(str(exc))
    except Exception as exc:  # only tolerated (counted) with the guard off
        if not case.overrides["debug"]["disable_alias_guard"]:
            raise
        t.crashes += 1
        t.examples.append(f"case {case.seed}: {type(exc).__name__}: {exc}")
    target.tally(t)
    s = target.engine.stats.snapshot()
    t.hits += s["hybridserve_prefix_hit_tokens_total"]
    t.preemptions += s["hybridserve_preemptions_total"]
    demoted, promoted = s["hybridserve_tier_demotions_total"], s["hybridserve_tier_promotions_total"]
    t.tiered += target.engine.cache.host is not None
    t.demotions += demoted.get("demoted", 0)
    t.promotions += promoted.get("promoted", 0)
    t.transfer_failures += demoted.get("failed", 0) + promoted.get("failed", 0)
    return t


def fuzz(
    model_dir, seeds, real: bool = False, guard_off: bool = False, control: Control | None = None, tiers: bool = False
) -> Tally:
    total = Tally()
    if real and control is None:
        control = Control(model_dir)
    for seed in seeds:
        case = draw(seed, guard_off, tiers)
        target = RealTarget(model_dir, case, control) if real else ToyTarget(model_dir, case)
        try:
            total.add(run_case(target, case))
        finally:
            target.close()
    return total


def main(argv: list[str] | None = None) -> None:
    import tempfile
    from pathlib import Path

    from tools.tiny import make_tiny_checkpoint

    ap = argparse.ArgumentParser(description="the differential fuzz of the engine (see module doc)")
    ap.add_argument("--toy", type=int, default=200, help="toy-model configurations")
    ap.add_argument("--real", type=int, default=20, help="real tiny-model configurations")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--guard-off", action="store_true", help="debug.disable_alias_guard (sensitivity)")
    ap.add_argument("--tiers", action="store_true", help="every case with the host tier on")
    args = ap.parse_args(argv)
    model_dir = make_tiny_checkpoint("qwen3_next", Path(tempfile.mkdtemp()), seed=0, mtp=True)
    for kind, n in (("toy", args.toy), ("real", args.real)):
        if n:
            t = fuzz(
                model_dir,
                range(args.first_seed, args.first_seed + n),
                real=kind == "real",
                guard_off=args.guard_off,
                tiers=args.tiers,
            )
            print(
                f"{kind}: configs {t.configs} ({t.tiered} with the host tier), requests {t.requests}, "
                f"steps {t.steps}, divergences {t.divergences}, violations {dict(t.violations)}, state "
                f"checks {t.state_checks}, mismatches {t.state_mismatches}, livelocks {t.livelocks}, "
                f"crashes {t.crashes}, hit tokens {t.hits}, preemptions {t.preemptions}, demotions "
                f"{t.demotions}, promotions {t.promotions}, forced transfer failures {t.transfer_failures}"
            )
            for line in t.examples:
                print("  ", line[:200])


if __name__ == "__main__":
    main()
