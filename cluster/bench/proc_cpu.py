"""CPU seconds of this process and of every process it started (Ray's GCS, raylet and
workers), read from ``/proc`` (Linux; elsewhere snapshots are empty).

``snapshot()`` walks the process tree below the root pid and records each process's user
+ system CPU time and its threads'; ``cpu_delta(before, after)`` gives the seconds each
process and thread spent between the two snapshots (a process that exited in between is
missing from ``after`` and counts 0; one that started counts from 0). Resolution is one
clock tick (10 ms on Linux), so compare runs of seconds, not single requests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcCpu:
    pid: int
    name: str  # cmdline (Ray workers: ``ray::ActorClass...``)
    cpu_s: float
    threads: dict[int, tuple[str, float]] = field(default_factory=dict)  # tid -> (comm, cpu_s)


def _stat(path: Path) -> tuple[str, int, float] | None:
    """(comm, ppid, user + system seconds) of one /proc stat file; None if it vanished."""
    try:
        raw = path.read_text()
    except OSError:
        return None
    comm = raw[raw.find("(") + 1 : raw.rfind(")")]
    fields = raw[raw.rfind(")") + 2 :].split()  # from field 3 (state) on
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def _cmdline(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
        return raw.replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (by parent pid), root first."""
    children: dict[int, list[int]] = {}
    for entry in PROC.glob("[0-9]*"):
        st = _stat(entry / "stat")
        if st is not None:
            children.setdefault(st[1], []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    out = {}
    for task in (PROC / str(pid) / "task").glob("[0-9]*"):
        st = _stat(task / "stat")
        if st is not None:
            out[int(task.name)] = (st[0], st[2])
    return out


def snapshot(root: int | None = None, with_threads: bool = True) -> dict[int, ProcCpu]:
    root = os.getpid() if root is None else root
    if not PROC.is_dir():
        return {}
    out = {}
    for pid in descendants(root):
        st = _stat(PROC / str(pid) / "stat")
        if st is not None:
            out[pid] = ProcCpu(pid, _cmdline(pid) or st[0], st[2], _threads(pid) if with_threads else {})
    return out


def cpu_delta(before: dict[int, ProcCpu], after: dict[int, ProcCpu]) -> dict[int, ProcCpu]:
    """Per process (and thread) CPU seconds spent between the snapshots."""
    out = {}
    for pid, a in after.items():
        b = before.get(pid)
        base = b.threads if b is not None else {}
        threads = {tid: (comm, s - base.get(tid, ("", 0.0))[1]) for tid, (comm, s) in a.threads.items()}
        out[pid] = ProcCpu(pid, a.name, a.cpu_s - (b.cpu_s if b is not None else 0.0), threads)
    return out


def role(name: str, pids: dict[str, set[int]] | None = None, pid: int = -1) -> str:
    """A process's part in a local Serve cluster, from its pid (when known) or its cmdline."""
    for known, members in (pids or {}).items():
        if pid in members:
            return known
    for key, label in (
        ("OpenAIIngress", "ingress"),
        ("EngineReplica", "replica"),
        ("ProxyActor", "proxy"),
        ("ServeController", "controller"),
        ("gcs_server", "ray_system"),
        ("raylet", "ray_system"),
        ("ray::", "other_ray_workers"),
    ):
        if key in name:
            return label
    return "other"


def ms_per_unit_by_role(
    delta: dict[int, ProcCpu], units: int, pids: dict[str, set[int]] | None = None
) -> dict[str, float]:
    """CPU ms per unit (an output token, say) of each ``role``, summed over its processes."""
    per_role: dict[str, float] = {}
    for pid, proc in delta.items():
        name = role(proc.name, pids, pid)
        per_role[name] = per_role.get(name, 0.0) + proc.cpu_s
    return {name: round(1e3 * s / max(units, 1), 3) for name, s in sorted(per_role.items())}
