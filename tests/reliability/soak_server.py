"""What a soak checks on the server side: replica counters and pools over HTTP, RSS from /proc.

- ``replica_stats``: ``GET /debug/replicas`` (one entry per live engine replica).
- ``idle_pools``: wait until no replica holds a stream or an unfinished request, then
  ``POST /flush_cache`` and read the pools; with the prefix cache flushed an idle replica
  holds no KV page and no Mamba slot, so two idle reads of a healthy replica are equal.
- ``violations``: ``hybridserve_invariant_violations_total`` per replica. With
  ``debug.check_invariants`` the engine recounts its cache after every step and counts
  each violation there (deployed engines count, they do not raise: a raise would kill the
  engine loop, fail every open stream with 503 and make the replica unhealthy).
- ``hybridserve_state_oracle_mismatches_total``: with ``debug.state_oracle_sample`` the engine
  recomputes that fraction of its published checkpoints by a fresh prefill; a mismatch is
  a checkpoint whose slot does not hold its path's state, and breaks the contract.
- ``engine_counters``: the engines' counters (``hybridserve_requests_total`` per finish
  reason, preemptions, evictions, prefix hits...), summed over replicas.
- ``run_checked``: idle pools, the soak, idle pools again, as a ``SoakResult``; its
  ``problems()`` are the soak's contract.
- ``replica_pids`` / ``rss_kib``: the engine replicas' Ray actors (the GCS actor table; the
  caller is connected to the cluster) and their resident set from ``/proc/<pid>/status``
  (the processes must run on this machine).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.bench.workloads import Renderer
from tests.reliability.soak import SoakReport, SoakSettings, run_soak

ENGINE_DEPLOYMENT = "EngineReplica"
VIOLATIONS = "hybridserve_invariant_violations_total"
CHECKS = "hybridserve_invariant_checks_total"
ORACLE_CHECKS = "hybridserve_state_oracle_checks_total"
ORACLE_MISMATCHES = "hybridserve_state_oracle_mismatches_total"
FINISHED = "hybridserve_requests_total"


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def replica_stats(base_url: str, api_key: str | None = None, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """``/debug/replicas``' entries (``ReplicaStats`` as dicts); raises on a non-200."""
    import httpx

    r = httpx.get(
        f"{base_url.rstrip('/')}/debug/replicas", headers=_headers(api_key), timeout=timeout_s, trust_env=False
    )
    r.raise_for_status()
    return list(r.json()["replicas"])


def wait_idle(base_url: str, api_key: str | None = None, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Replica stats once every replica has no open stream and no unfinished request.

    Disconnected streams are aborted asynchronously, so a soak's end waits here; raises
    TimeoutError (with the last stats) when the replicas stay busy for ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        stats = replica_stats(base_url, api_key)
        if all(s["num_streams"] == 0 and not s["has_unfinished"] for s in stats):
            return stats
        if time.monotonic() > deadline:
            busy = [(s["replica_label"], s["num_streams"], s["has_unfinished"]) for s in stats]
            raise TimeoutError(f"replicas still busy after {timeout_s}s (label, streams, unfinished): {busy}")
        time.sleep(0.1)


def idle_pools(base_url: str, api_key: str | None = None, timeout_s: float = 60.0) -> dict[str, dict[str, int]]:
    """Pool counts per replica id, read idle and right after a cache flush."""
    import httpx

    wait_idle(base_url, api_key, timeout_s)
    r = httpx.post(f"{base_url.rstrip('/')}/flush_cache", headers=_headers(api_key), timeout=timeout_s, trust_env=False)
    r.raise_for_status()
    return {s["replica_id"]: dict(s["pools"]) for s in replica_stats(base_url, api_key)}


def violations(stats: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Invariant violations per replica label, by invariant; ValueError if not counted at all."""
    out: dict[str, dict[str, int]] = {}
    for s in stats:
        counted = s["counters"].get(VIOLATIONS)
        if not isinstance(counted, dict):
            raise ValueError(f"replica {s['replica_label']} exports no {VIOLATIONS}: cannot check invariants")
        out[s["replica_label"]] = {k: int(v) for k, v in counted.items() if v}
    return out


def engine_counters(stats: list[dict[str, Any]]) -> Counter[str]:
    """Every engine counter summed over the replicas; a labelled one as ``name{label}``."""
    total: Counter[str] = Counter()
    for s in stats:
        for name, value in s["counters"].items():
            if name.endswith("_total") and isinstance(value, int):
                total[name] += value
            elif name.endswith("_total") and isinstance(value, dict):
                total.update({f"{name}{{{k}}}": int(v) for k, v in value.items()})
    return total


def replica_pids(app_name: str, deployment: str = ENGINE_DEPLOYMENT) -> dict[str, int]:
    """Actor id -> pid of the live replicas of ``app_name``'s ``deployment``.

    Serve names a replica actor's class ``ServeReplica:<app>:<deployment>``. Read from the
    GCS actor table: ``ray.util.state.list_actors`` would need the dashboard, which a
    cluster started with ``include_dashboard=False`` (the test session's) does not run.
    """
    from ray._private import state

    suffix = f":{app_name}:{deployment}"
    table = state.actors(actor_state_name="ALIVE")
    pids = {aid: int(a["Pid"]) for aid, a in table.items() if str(a["ActorClassName"]).endswith(suffix) and a["Pid"]}
    if not pids:
        raise ValueError(f"no live actor of class *{suffix} (app {app_name!r}, deployment {deployment!r})")
    return pids


def rss_kib(pid: int) -> int:
    """``VmRSS`` of a process on this machine, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/status has no VmRSS line (a zombie or kernel thread?)")


def rss_growth(before: dict[int, int], after: dict[int, int]) -> dict[int, float]:
    """Relative RSS growth per pid present in both samples (0.05 = +5 %)."""
    missing = sorted(set(before) ^ set(after))
    if missing:
        raise ValueError(f"RSS samples cover different processes (a replica was replaced?): {missing}")
    return {pid: after[pid] / before[pid] - 1.0 for pid in before}


# -- a checked soak -----------------------------------------------------------------------------
@dataclass
class SoakResult:
    """A soak's client report and the server's state around it (pools idle and flushed)."""

    report: SoakReport
    pools_before: dict[str, dict[str, int]]
    pools_after: dict[str, dict[str, int]]
    violations: dict[str, dict[str, int]]
    counters_delta: dict[str, int]  # engine counters' growth during the soak (non-zero ones)
    rss_warm_kib: dict[int, int] = field(default_factory=dict)
    rss_end_kib: dict[int, int] = field(default_factory=dict)

    @property
    def finished_delta(self) -> dict[str, int]:
        """Engine requests finished during the soak, by finish reason."""
        prefix = f"{FINISHED}{{"
        return {k[len(prefix) : -1]: v for k, v in self.counters_delta.items() if k.startswith(prefix)}

    def problems(self, max_rss_growth: float = 0.10) -> list[str]:
        """Everything that breaks the soak's contract; empty when it held."""
        out = [
            f"{n} x {outcome}, first: {next(r.detail for r in self.report.failures() if r.outcome == outcome)}"
            for outcome, n in Counter(r.outcome for r in self.report.failures()).items()
        ]
        if any(self.violations.values()):
            out.append(f"invariant violations: {self.violations}")
        if not self.counters_delta.get(CHECKS):
            out.append(f"no invariant checks ran ({CHECKS} did not grow): is debug.check_invariants on?")
        if self.counters_delta.get(ORACLE_MISMATCHES):
            out.append(
                f"{self.counters_delta[ORACLE_MISMATCHES]} of "
                f"{self.counters_delta.get(ORACLE_CHECKS)} "
                "recomputed checkpoints did not hold their path's state"
            )
        if self.pools_after != self.pools_before:
            out.append(f"pools not back at idle: before {self.pools_before}, after {self.pools_after}")
        grown = {pid: g for pid, g in rss_growth(self.rss_warm_kib, self.rss_end_kib).items() if g >= max_rss_growth}
        if grown:
            out.append(f"RSS grew >= {max_rss_growth:.0%} after warm-up: {grown}")
        outcomes = self.report.counts(lambda r: r.outcome)
        served = outcomes.get("ok", 0) + outcomes.get("disconnected", 0)
        engine = sum(self.finished_delta.values())
        if not self.report.failures() and engine != served:
            out.append(
                f"the engines finished {engine} requests {self.finished_delta}, the client "
                f"completed or dropped {served}"
            )
        return out

    def format(self) -> str:
        fig = self.report.figures()
        lines = [f"soak of {self.report.model}: {fig.pop('requests')} requests in {fig.pop('duration_s')} s"]
        lines += [f"  {k}: {v}" for k, v in fig.items()]
        lines.append(f"  engine finished (by reason): {self.finished_delta}")
        lines.append(f"  engine counters (growth): {self.counters_delta}")
        lines.append(f"  invariant violations: {self.violations}")
        for pid in sorted(self.rss_warm_kib):
            warm, end = self.rss_warm_kib[pid], self.rss_end_kib.get(pid, 0)
            lines.append(
                f"  RSS pid {pid}: {warm / 1024:.1f} MiB after warm-up -> {end / 1024:.1f} MiB "
                f"at the end ({end / warm - 1:+.2%})"
            )
        for rid, pools in self.pools_before.items():
            lines.append(f"  pools {rid[-12:]}: idle {pools} -> end {self.pools_after.get(rid)}")
        return "\n".join(lines)


def run_checked(
    base_url: str,
    settings: SoakSettings,
    api_key: str | None = None,
    renderer: Renderer | None = None,
    pids: list[int] | None = None,
    idle_timeout_s: float = 120.0,
) -> SoakResult:
    """Idle pools, the soak (RSS of ``pids`` sampled after warm-up), idle pools again."""
    import asyncio

    from cluster.bench.client import Target

    pools_before = idle_pools(base_url, api_key, idle_timeout_s)
    counters_before = engine_counters(replica_stats(base_url, api_key))
    rss_warm: dict[int, int] = {}

    def on_warm() -> None:
        rss_warm.update({pid: rss_kib(pid) for pid in pids or []})

    report = asyncio.run(run_soak(Target(base_url, api_key=api_key), settings, renderer, on_warm))
    stats = wait_idle(base_url, api_key, idle_timeout_s)
    rss_end = {pid: rss_kib(pid) for pid in pids or []}
    delta = engine_counters(stats) - counters_before  # Counter subtraction keeps the positive
    return SoakResult(
        report,
        pools_before,
        idle_pools(base_url, api_key, idle_timeout_s),
        violations(stats),
        dict(sorted(delta.items())),
        rss_warm,
        rss_end,
    )
