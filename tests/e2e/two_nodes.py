"""A two-node Ray cluster on this machine: ``ray start --head`` and ``ray start --address``
as separate processes with separate resources, for tests that kill a node.

Each node is a ``ray start --block`` process in its own session (process group), so
``kill_worker`` can take the whole worker node down at once -- raylet, object store,
workers -- the way a machine dies, and ``stop`` removes everything this cluster started
(never ``ray stop``: that would stop every Ray on the machine). The cluster uses its own
temp dir, its own ports and token authentication with a token of its own.

Resources: the head has ``head_node`` (the app's ingress and named actors go there) and
``REPLICA_SLOTS`` engine-replica slots, the worker has one slot: replicas spread over both
nodes, and the head can take the worker's replica back when the worker dies.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.net import free_port

RAY = str(Path(sys.executable).with_name("ray"))
REPLICA_RESOURCE = "tiers_replica"
REPLICA_SLOTS = 2


class TwoNodeCluster:
    def __init__(self, root: Path, head_cpus: int = 4, worker_cpus: int = 2) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        token = root / "token"
        token.write_text(secrets.token_hex(32))
        self.env = {
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token),
            # notice a dead node within a few seconds, not half a minute
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_initial_delay_ms": "1000",
        }
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.head_cpus, self.worker_cpus = head_cpus, worker_cpus
        self.head: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        # Ray's socket paths must stay under 108 bytes: a short temp dir of its own.
        self.ray_dir = Path(tempfile.mkdtemp(prefix="h2n-", dir="/tmp"))

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")
        return subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start(self, timeout_s: float = 120.0) -> TwoNodeCluster:
        self.head = self._start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                f"--num-cpus={self.head_cpus}",
                "--include-dashboard=false",
                f"--temp-dir={self.ray_dir}",
                "--resources=" + json.dumps({"head_node": 100, REPLICA_RESOURCE: REPLICA_SLOTS}),
            ],
        )
        self.wait_nodes(1, timeout_s)
        self.worker = self._start(
            "worker",
            [
                f"--address={self.address}",
                f"--num-cpus={self.worker_cpus}",
                "--resources=" + json.dumps({"worker_node": 100, REPLICA_RESOURCE: 1}),
            ],
        )
        self.wait_nodes(2, timeout_s)
        return self

    def alive_nodes(self) -> int:
        code = (
            "import ray, json; ray.init(address=%r, logging_level='ERROR'); "
            "print(json.dumps(sum(n['Alive'] for n in ray.nodes())))" % self.address
        )
        out = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60)
        try:
            return int(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return 0

    def wait_nodes(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.alive_nodes() != n:
            if time.monotonic() > deadline:
                logs = "".join(
                    (self.root / f).read_text()[-1500:] for f in ("head.log", "worker.log") if (self.root / f).exists()
                )
                raise AssertionError(f"the cluster did not reach {n} alive nodes in {timeout_s}s:\n{logs}")
            time.sleep(1.0)

    def kill_worker(self) -> None:
        """The worker node dies: every process of it at once (SIGKILL to its group)."""
        assert self.worker is not None
        os.killpg(self.worker.pid, signal.SIGKILL)
        self.worker.wait(timeout=30)

    def stop(self) -> None:
        for proc in (self.worker, self.head):
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        shutil.rmtree(self.ray_dir, ignore_errors=True)

    def run_driver(self, args: list[str], timeout_s: float) -> dict:
        """``python -m tests.e2e.two_node_driver ARGS`` on this cluster; its last stdout line (JSON)."""
        out = subprocess.run(
            [sys.executable, "-m", "tests.e2e.two_node_driver", "--address", self.address, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if out.returncode != 0:
            raise AssertionError(
                f"driver {args[:1]} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
            )
        return json.loads(out.stdout.strip().splitlines()[-1])
