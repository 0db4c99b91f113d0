"""A real Prometheus scrapes a live local cluster while a short load runs; then every
dashboard panel's PromQL, asked through Prometheus's HTTP API, returns data.

The app (two replicas, MTP speculation, invariant checks, some forced track-slot
allocation failures, the host tier and the cluster store) runs on the session's Ray
cluster; Prometheus (Debian's package, ``deploy/prometheus/install.sh``) scrapes its
metrics actor and Ray's metrics agent on 127.0.0.1 every second, with the shipped alert
rules loaded. The load runs until every
panel has a finite value (or a deadline), mixing cache hits, streaming and a few 404s
(so Serve's error counter exists), with a marker in request ids and prompts that must
never show up in a label.
"""

from __future__ import annotations

import math
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from cluster.observability.dashboards import DASHBOARDS
from cluster.observability.dashboards.model import metric_names, substitute
from cluster.observability.dashboards.pd import PD
from cluster.observability.prometheus_local import (
    ALERTS,
    LocalPrometheus,
    ScrapeJob,
    find_prometheus,
    local_ray_targets,
)
from tests.conftest import ServeSession
from tests.e2e.conftest import FAST_PUBLISH, SMALL_ENGINE, DeployedApp, deploy

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
APP = "obs"
MARKER = "zqxobsmarker"  # in request ids and prompt text; never in a label
VALUES = {
    "model": APP,
    "application": APP,
    "replica": ".*",
    "__rate_interval": "1m",
    "__range": "5m",
    "__interval": "15s",
}
SATISFY_TIMEOUT_S = 120
# Panels this load must move (every target above 0): the rest may legitimately read 0
# (invariant violations, preemptions, gauges after the load stopped, random-model acceptance).
MUST_MOVE = {
    "Time to first token",
    "Time per output token",
    "End-to-end request latency",
    "Request throughput",
    "Token throughput",
    "KV and Mamba pool usage",
    "Prefix cache hit ratio",
    "Prefix tokens looked up and hit",
    "Donations made and skipped",
    "Generated tokens per replica",
    "Cache-hit share per replica",
    "Router decisions by reason",
    "Router decision share",
    "Serve request rate",
    "Serve error rate",
    "Serve HTTP latency",
    "Deployment request rate per replica",
    "Deployment processing latency",
}
MAY_STAY_ZERO = {
    ("Donations made and skipped", "skipped {{path}}")  # needs a pending writer at donation time
}
# The prefill/decode row reads what only a disaggregated app exports (its ingress's routes,
# hand-offs): this app is colocated (PD's series: tests/e2e/test_pd.py).
PD_ONLY_PANELS = {panel.title for panel in PD.panels}
PD_ONLY_METRICS = {name for panel in PD.panels for t in panel.targets for name in metric_names(t.expr)}
ENGINE_LABELS = {
    "__name__",
    "job",
    "instance",
    "model",
    "replica",
    "le",
    "phase",
    "path",
    "invariant",
    "tier",
    "outcome",
    "direction",
    "finish_reason",
    "reason",
}


@dataclass
class Live:
    app: DeployedApp
    prom: LocalPrometheus
    unsatisfied: list[str]
    load_s: float


@dataclass(frozen=True)
class Query:
    name: str  # dashboard / panel / legend
    expr: str  # variables substituted
    must_move: bool  # some value > 0, not only a finite one


def panel_queries() -> list[Query]:
    return [
        Query(
            f"{d.uid} / {panel.title} / {target.legend or target.expr[:40]}",
            substitute(target.expr, VALUES),
            panel.title in MUST_MOVE and (panel.title, target.legend) not in MAY_STAY_ZERO,
        )
        for d in DASHBOARDS
        for panel, target in d.targets()
        if panel.title not in PD_ONLY_PANELS
    ]


def satisfied(prom: LocalPrometheus, q: Query) -> bool:
    values = [float(r["value"][1]) for r in prom.query(q.expr)]
    return any(v > 0 for v in values) if q.must_move else any(math.isfinite(v) for v in values)


class Load:
    """Three client threads until ``stop``: shared-prefix token prompts (cache hits),
    streamed text prompts, and every so often a request for an unknown model (404)."""

    def __init__(self, app: DeployedApp, threads: int = 3) -> None:
        self.app, self.done, self.errors = app, threading.Event(), []
        rng = random.Random(0)
        self.prefixes = [[rng.randrange(10, 400) for _ in range(24)] for _ in range(3)]
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=60)

    def _run(self, k: int) -> None:
        rng = random.Random(k)
        with httpx.Client(base_url=self.app.openai_base, timeout=60) as http:
            n = 0
            while not self.done.is_set():
                n += 1
                headers = {"x-request-id": f"{MARKER}-{uuid.uuid4().hex}"}
                body = {"model": APP, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
                try:
                    if n % 7 == 0:
                        r = http.post(
                            "/completions", json={**body, "model": "no-such-model", "prompt": "x"}, headers=headers
                        )
                        assert r.status_code == 404, r.text
                    elif n % 3 == 0:
                        prompt = f"{MARKER} tell me about the number {rng.randrange(1000)}"
                        with http.stream(
                            "POST", "/completions", json={**body, "prompt": prompt, "stream": True}, headers=headers
                        ) as r:
                            assert r.status_code == 200
                            for _ in r.iter_lines():
                                pass
                    else:
                        suffix = [rng.randrange(10, 400) for _ in range(rng.randrange(1, 9))]
                        prompt = rng.choice(self.prefixes) + suffix
                        r = http.post("/completions", json={**body, "prompt": prompt}, headers=headers)
                        assert r.status_code == 200, r.text
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.errors.append(repr(exc))
                    time.sleep(0.5)


@pytest.fixture(scope="module")
def live(serve_session: ServeSession, tiny_qwen_dir) -> Iterator[Live]:
    if find_prometheus() is None:
        pytest.skip("prometheus is not installed and could not be: run deploy/prometheus/install.sh as root")
    from ray import serve

    tiers = {
        **SMALL_ENGINE["cache"],
        "host_mamba_slots": 16,
        "host_kv_tokens": 1024,
        "cluster_store_bytes": 64 << 20,
    }  # the tier and store panels have series
    app = deploy(
        serve_session,
        APP,
        str(tiny_qwen_dir),
        overrides={
            "parallel": {"num_replicas": 2},
            "spec": {"method": "mtp", "num_draft_tokens": 2},
            "cache": tiers,
            "debug": {"check_invariants": True, "fail_pending_alloc_prob": 0.3},
        },
        args={"model_name": APP, "replica": {**FAST_PUBLISH, "stats_interval_s": 0.5}},
    )
    try:
        metrics = urlparse(app.metrics_url)
        jobs = [ScrapeJob("hybridserve", (f"127.0.0.1:{metrics.port}",)), ScrapeJob("ray", local_ray_targets())]
        with LocalPrometheus(jobs, scrape_interval_s=1.0, extra_config={"rule_files": [str(ALERTS)]}) as prom:
            start = time.monotonic()
            with Load(app) as load:
                pending = panel_queries()
                while pending and time.monotonic() - start < SATISFY_TIMEOUT_S:
                    time.sleep(2)
                    pending = [q for q in pending if not satisfied(prom, q)]
            assert not load.errors, load.errors[:5]
            yield Live(app, prom, [q.name for q in pending], time.monotonic() - start)
    finally:
        serve.delete(APP)


def query_eventually(prom: LocalPrometheus, expr: str, timeout_s: float = 30.0) -> list:
    """An instant query's result, retried while empty: one scrape that timed out on a loaded
    machine marks the target's series stale, and they are back at the next good scrape."""
    deadline = time.monotonic() + timeout_s
    while not (result := prom.query(expr)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return result


def test_every_panel_returns_data(live):
    assert live.unsatisfied == [], f"no (or no moving) data after {live.load_s:.0f}s of load: {live.unsatisfied}"
    for q in panel_queries():
        assert query_eventually(live.prom, q.expr), q.name


def test_prompt_tokens_count_cache_hits(live):
    """Every prompt of this load has at least 4 tokens, cached or not."""
    prompt = query_eventually(live.prom, f'sum(hybridserve_prompt_tokens_total{{model="{APP}"}})')
    finished = query_eventually(live.prom, f'sum(hybridserve_requests_total{{model="{APP}"}})')
    assert float(prompt[0]["value"][1]) >= 4 * float(finished[0]["value"][1]) > 0


def test_every_referenced_metric_is_exported(live):
    exported = set(live.prom.api("label/__name__/values"))
    for d in DASHBOARDS:
        assert d.metric_names() - PD_ONLY_METRICS <= exported, sorted(d.metric_names() - PD_ONLY_METRICS - exported)
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    for rule in rules:
        assert metric_names(rule["expr"]) <= exported, rule["alert"]


def test_template_variables_resolve(live):
    for d in DASHBOARDS:
        for v in d.variables:
            selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", v.query).groups()
            values = live.prom.api(f"label/{label}/values", **{"match[]": substitute(selector, VALUES)})
            expected = [APP] if label in ("model", "application") else ["0", "1"]
            assert set(expected) <= set(values), (v.name, values)


def test_alert_rules_load_and_none_fires(live):
    groups = live.prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 4 and all(r["health"] == "ok" for r in rules), rules
    firing = [a["labels"]["alertname"] for a in live.prom.api("alerts")["alerts"]]
    assert "HybridserveInvariantViolation" not in firing


def test_label_cardinality_is_bounded(live):
    ours = live.prom.api("series", **{"match[]": '{__name__=~"hybridserve_.+"}'})
    assert 0 < len(ours) <= 400, len(ours)
    assert {name for s in ours for name in s} <= ENGINE_LABELS
    # "store": the store actor's own series
    assert {s["replica"] for s in ours if "replica" in s} == {"0", "1", "store"}
    assert {s["model"] for s in ours} == {APP}
    everything = live.prom.api("series", **{"match[]": '{__name__=~".+"}'})
    leaked = [s for s in everything if any(MARKER in v for v in s.values())]
    assert not leaked, leaked[:3]
