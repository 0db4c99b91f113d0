"""A throwaway Prometheus for a local cluster (``hybridserve serve --with-prometheus``, tests).

Runs the ``prometheus`` binary directly (Debian's package, never its service) with a
config written for the live ports, ``--web.listen-address=127.0.0.1:PORT`` and a temporary
storage directory that is deleted on ``stop``. It opens no other port and starts no
exporter. Two scrape jobs, named as in ``deploy/prometheus/prometheus.yml``:

- ``hybridserve``: the metrics actor (``hybridserve_*``, labels ``model``, ``replica``) on
  ``metrics.port``;
- ``ray``: every local Ray node's metrics agent (``ray_*``, including ``ray_serve_*``), at
  the export port each node reports in ``ray.nodes()``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster.net import free_port
from configs.schema import HybridServeConfig

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
INSTALL_HINT = "install it with deploy/prometheus/install.sh (Debian: apt-get install prometheus)"
_LOOPBACK_HOSTS = ("0.0.0.0", "::", "127.0.0.1", "localhost", "")


@dataclass(frozen=True)
class ScrapeJob:
    name: str
    targets: tuple[str, ...]  # host:port
    metrics_path: str = "/metrics"


def find_prometheus(binary: str | None = None) -> str | None:
    """The prometheus executable: ``binary`` (a path or a name) if runnable, else from PATH."""
    return shutil.which(binary or "prometheus")


def render_config(jobs: Sequence[ScrapeJob], scrape_interval_s: float) -> str:
    interval = f"{max(1, round(scrape_interval_s * 1000))}ms"
    doc = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": job.name, "metrics_path": job.metrics_path, "static_configs": [{"targets": list(job.targets)}]}
            for job in jobs
            if job.targets
        ],
    }
    return yaml.safe_dump(doc, sort_keys=False)


def metrics_actor_target(config: HybridServeConfig) -> str:
    host = config.server.host
    return f"{'127.0.0.1' if host in _LOOPBACK_HOSTS else host}:{config.metrics.port}"


def local_ray_targets() -> tuple[str, ...]:
    """``host:port`` of the alive Ray nodes' metrics agents (needs ``ray.init`` done).

    Nodes on this machine are addressed through 127.0.0.1 (the agent listens on every
    interface), so a local cluster is scraped over loopback only.
    """
    import ray

    local_ip = ray.util.get_node_ip_address()
    out = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        host = node["NodeManagerAddress"]
        out.append(f"{'127.0.0.1' if host == local_ip else host}:{port}")
    return tuple(sorted(set(out)))


def cluster_jobs(config: HybridServeConfig) -> list[ScrapeJob]:
    return [ScrapeJob("hybridserve", (metrics_actor_target(config),)), ScrapeJob("ray", local_ray_targets())]


class LocalPrometheus:
    """One prometheus subprocess on 127.0.0.1; ``start``/``stop`` or ``with``."""

    def __init__(
        self,
        jobs: Sequence[ScrapeJob],
        port: int = 0,
        scrape_interval_s: float = 1.0,
        binary: str | None = None,
        extra_config: dict[str, Any] | None = None,
    ) -> None:
        found = find_prometheus(binary)
        if found is None:
            raise ValueError(f"no prometheus binary ({binary or 'prometheus'} not on PATH); {INSTALL_HINT}")
        self.binary = found
        self.jobs = list(jobs)
        self.port = port or free_port()
        self.scrape_interval_s = scrape_interval_s
        self.extra_config = extra_config or {}
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> LocalPrometheus:
        """Start and wait until ready; ValueError if the port is taken, RuntimeError if
        prometheus exits or is not ready within ``timeout_s`` (with its log's tail)."""
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", self.port))
            except OSError as exc:
                raise ValueError(f"cannot run prometheus on 127.0.0.1:{self.port}: {exc}") from exc
        self._dir = Path(tempfile.mkdtemp(prefix="hybridserve-prometheus-"))
        config = yaml.safe_load(render_config(self.jobs, self.scrape_interval_s))
        config.update(self.extra_config)
        (self._dir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [
            self.binary,
            f"--config.file={self._dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self._dir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        with (self._dir / "prometheus.log").open("wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after {timeout_s}s: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, num_chars: int = 2000) -> str:
        path = self._dir / "prometheus.log" if self._dir else None
        return path.read_text(errors="replace")[-num_chars:] if path and path.exists() else ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; returns ``data``; raises RuntimeError on an API error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query; the result vector (or scalar, as a one-element list)."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]


@contextlib.contextmanager
def prometheus_for_cluster(
    config: HybridServeConfig, port: int = 9090, scrape_interval_s: float = 2.0
) -> Iterator[LocalPrometheus]:
    """A Prometheus scraping the running local cluster (``ray.init`` done), with the
    shipped alert rules loaded."""
    jobs = cluster_jobs(config)
    rules = {"rule_files": [str(ALERTS)]} if ALERTS.exists() else {}
    with LocalPrometheus(jobs, port=port, scrape_interval_s=scrape_interval_s, extra_config=rules) as prom:
        targets = ", ".join(t for job in jobs for t in job.targets)
        print(f"hybridserve: prometheus at {prom.url} (scraping {targets})", flush=True)
        yield prom


def prometheus_sidecar(
    config: HybridServeConfig, port: int = 9090
) -> Callable[[], contextlib.AbstractContextManager[LocalPrometheus]]:
    """``serve --with-prometheus``: fail now (ValueError) if there is no binary, start later."""
    if find_prometheus() is None:
        raise ValueError(f"--with-prometheus: no prometheus binary on PATH; {INSTALL_HINT}")
    return lambda: prometheus_for_cluster(config, port)
