"""``cluster.observability.prometheus_local`` without Ray: a real Prometheus scraping a real
``prometheus_client`` server on loopback; the shipped config and alert rules; the CLI flag."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from cluster import cli
from cluster.observability import prometheus_local as pl
from cluster.observability.metrics_registry import MetricsRegistry
from configs.schema import load_config
from workers.stats import EngineStats

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
needs_prometheus = pytest.mark.skipif(
    pl.find_prometheus() is None, reason=f"prometheus not installed; {pl.INSTALL_HINT}"
)
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")


def test_rendered_config_has_the_jobs_and_interval():
    text = pl.render_config(
        [pl.ScrapeJob("hybridserve", ("127.0.0.1:9464",)), pl.ScrapeJob("ray", ())], scrape_interval_s=1.0
    )
    doc = yaml.safe_load(text)
    assert doc["global"]["scrape_interval"] == "1000ms"
    assert [j["job_name"] for j in doc["scrape_configs"]] == ["hybridserve"]  # empty jobs dropped
    assert doc["scrape_configs"][0]["static_configs"] == [{"targets": ["127.0.0.1:9464"]}]


def test_metrics_actor_target_is_loopback_for_a_local_server():
    config = load_config(overrides={"server": {"host": "0.0.0.0"}, "metrics": {"port": 9999}})
    assert pl.metrics_actor_target(config) == "127.0.0.1:9999"


def test_shipped_config_uses_the_same_job_names():
    shipped = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert [j["job_name"] for j in shipped["scrape_configs"]] == ["hybridserve", "ray"]
    config = load_config()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl, "local_ray_targets", lambda: ("127.0.0.1:1",))
        assert [j.name for j in pl.cluster_jobs(config)] == ["hybridserve", "ray"]


@needs_promtool
def test_shipped_config_and_alert_rules_pass_promtool():
    for args in (["check", "config", "prometheus.yml"], ["test", "rules", "alerts_test.yml"]):
        out = subprocess.run(["promtool", *args], cwd=PROM_DIR, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def _listening_addresses(pid: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


@needs_prometheus
def test_local_prometheus_scrapes_on_loopback_and_cleans_up():
    reg = MetricsRegistry()
    stats = EngineStats()
    stats.inc("hybridserve_generation_tokens_total", 7)
    reg.update_replica("m", "0", stats.snapshot(), stats.drain_observations())

    class Collector:
        def collect(self):
            return reg.collect()

    prom_registry = CollectorRegistry(auto_describe=False)
    prom_registry.register(Collector())
    server, thread = start_http_server(0, addr="127.0.0.1", registry=prom_registry)
    try:
        job = pl.ScrapeJob("hybridserve", (f"127.0.0.1:{server.server_port}",))
        prom = pl.LocalPrometheus([job], scrape_interval_s=0.5)
        with prom:
            pid, data_dir = prom._proc.pid, prom._dir
            deadline = time.monotonic() + 30
            while not (result := prom.query('hybridserve_generation_tokens_total{replica="0"}')):
                assert time.monotonic() < deadline, prom.log_tail()
                time.sleep(0.3)
            assert float(result[0]["value"][1]) == 7
            assert result[0]["metric"]["job"] == "hybridserve"
            assert prom.query("hybridserve_invariant_violations_total") != []  # exported at 0
            if shutil.which("ss"):
                addrs = _listening_addresses(pid)
                assert addrs and all(a.startswith("127.0.0.1:") for a in addrs), addrs
            with pytest.raises(RuntimeError, match="bad_data"):
                prom.query("rate(")
        assert prom._proc is None and not data_dir.exists()
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_missing_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(pl.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="install.sh"):
        pl.LocalPrometheus([pl.ScrapeJob("x", ("127.0.0.1:1",))])
    with pytest.raises(ValueError, match="--with-prometheus"):
        pl.prometheus_sidecar(load_config())


def test_taken_port_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(pl.shutil, "which", lambda name: "/bin/true")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        prom = pl.LocalPrometheus([pl.ScrapeJob("x", ("127.0.0.1:1",))], port=taken.getsockname()[1])
        with pytest.raises(ValueError, match="cannot run prometheus"):
            prom.start()


def test_serve_with_prometheus_hands_a_sidecar_to_serve_forever(monkeypatch):
    import cluster.serve_local as serve_local

    seen = {}
    monkeypatch.setattr(pl, "find_prometheus", lambda binary=None: "/usr/bin/prometheus")
    monkeypatch.setattr(serve_local, "serve_forever", lambda config, **kw: seen.update(kw) or 0)
    assert cli.main(["serve", "--with-prometheus", "--prometheus-port", "0"]) == 0
    assert callable(seen["sidecar"])
    assert cli.main(["serve"]) == 0 and seen["sidecar"] is None
