"""The dashboards as code: checked-in JSON is current, panels are well formed, every
hybridserve_* name they read is one the metrics registry exports, and every expression
is valid PromQL (promtool, when installed). The live check is test_live_prometheus.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.observability.dashboards import CLUSTER, DASHBOARDS, ENGINE
from cluster.observability.dashboards.model import metric_names, substitute, variables_in
from cluster.observability.dashboards.writer import OUT_DIR, file_name, render, stale_files
from cluster.observability.metrics_registry import PD_REQUESTS, MetricsRegistry
from cluster.store.checkpoint_store import CheckpointStore
from workers.stats import STORE_COUNTERS, STORE_GAUGES, EngineStats

GRAFANA_BUILTINS = {"__rate_interval": "1m", "__range": "5m", "__interval": "15s"}
HYBRIDSERVE_LABELS = {
    "model",
    "replica",
    "le",
    "phase",
    "path",
    "invariant",
    "finish_reason",
    "reason",
    "tier",
    "outcome",
    "direction",
    "route",  # hybridserve_pd_requests_total: three values
}
# What the issue asks each dashboard to show (a title may cover several items).
REQUIRED_PANELS = {
    ENGINE.uid: {
        "Time to first token",
        "Time per output token",
        "End-to-end request latency",
        "Request throughput",
        "Token throughput",
        "Running and waiting requests",
        "KV and Mamba pool usage",
        "Prefix cache hit ratio",
        "Checkpoints inserted and evicted",
        "Donations made and skipped",
        "Pending-slot allocation failures",
        "In-place track writes",
        "Invariant violations",
        "Speculative acceptance rate",
        "Preemptions",
        # the tiers: hits by tier, promotions, demotions, fetches, bytes moved, host KV
        # with no checkpoint under it
        "Cache hits by tier",
        "Promotions and demotions",
        "Bytes moved between tiers",
        "Store fetches and commits",
        "Host tier usage",
        "Host KV with no checkpoint under it",
    },
    CLUSTER.uid: {
        "Load per replica",
        "Router decisions by reason",
        "Cache-hit share per replica",
        "Serve request rate",
        "Serve error rate",
        "Serve HTTP latency",
        "Store objects",
        "Store bytes",
    },
}


def exported_names() -> set[str]:
    """Every sample name the metrics actor serves once a replica and a router have pushed."""
    reg = MetricsRegistry()
    stats = EngineStats()
    for name in stats.observations:
        stats.observe(name, 0.01)
    reg.update_replica("m", "0", stats.snapshot(), stats.drain_observations())
    store = CheckpointStore(1).stats()
    assert set(store) == set(STORE_GAUGES + STORE_COUNTERS)  # the store pushes workers/stats names
    reg.update_replica("m", "store", store, {})
    reg.add_router_decisions("m", {"prefix": 1})
    reg.add_ingress_count("m", PD_REQUESTS, "direct")  # a disaggregated app's ingress

    class Collector:
        def collect(self):
            return reg.collect()

    prom = CollectorRegistry(auto_describe=False)
    prom.register(Collector())
    text = generate_latest(prom).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def all_values() -> dict[str, str]:
    return {**GRAFANA_BUILTINS, "model": ".*", "replica": ".*", "application": ".*", "datasource": "x"}


def test_checked_in_json_is_what_the_code_renders():
    assert stale_files() == [], "regenerate with: python -m cluster.observability.dashboards"
    for d in DASHBOARDS:
        assert json.loads((OUT_DIR / file_name(d)).read_text()) == json.loads(render(d))


def test_uids_ids_titles_and_datasource():
    assert [d.uid for d in DASHBOARDS] == ["hybridserve-engine", "hybridserve-cluster"]
    for d in DASHBOARDS:
        doc = d.to_grafana()
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids))
        titles = [p.title for p in d.panels()]
        assert len(titles) == len(set(titles)), titles
        assert REQUIRED_PANELS[d.uid] <= set(titles)
        assert all(p.description for p in d.panels())
        variables = doc["templating"]["list"]
        assert variables[0]["name"] == "datasource" and variables[0]["type"] == "datasource"
        for panel in (p for p in doc["panels"] if p["type"] != "row"):
            assert panel["datasource"]["uid"] == "${datasource}"
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
            grid = panel["gridPos"]
            assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24


def test_layout_does_not_overlap():
    for d in DASHBOARDS:
        cells = set()
        for p in d.to_grafana()["panels"]:
            g = p["gridPos"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, p["title"]
            cells |= mine


def test_every_variable_is_defined_and_every_expression_reads_a_metric():
    for d in DASHBOARDS:
        defined = {v.name for v in d.variables} | set(GRAFANA_BUILTINS) | {"datasource"}
        for panel, target in d.targets():
            assert metric_names(target.expr), (panel.title, target.expr)
            assert variables_in(target.expr) <= defined, (panel.title, target.expr)
        for v in d.variables:
            assert variables_in(v.query) <= defined


def test_hybridserve_names_are_exported_and_labels_are_bounded():
    exported = exported_names()
    for d in DASHBOARDS:
        for panel, target in d.targets():
            names = metric_names(target.expr)
            ours = {n for n in names if n.startswith("hybridserve_")}
            assert ours <= exported, (panel.title, ours - exported)
            assert all(n.startswith("ray_serve_") for n in names - ours), (panel.title, names)
            if ours == names:  # only our series: only our labels
                used = set(re.findall(r"(\w+)\s*=~?", target.expr))
                for group in re.findall(r"by \(([^)]*)\)", target.expr):
                    used |= {x.strip() for x in group.split(",")}
                assert used <= HYBRIDSERVE_LABELS, (panel.title, used - HYBRIDSERVE_LABELS)


def test_rate_ratios_not_gauges_for_prefix_hits():
    """Hit ratios are a ratio of counter rates (the issue: not a gauge)."""
    for d in DASHBOARDS:
        for panel, target in d.targets():
            if "hybridserve_prefix_hit_tokens_total" in target.expr:
                assert "rate(hybridserve_prefix_hit_tokens_total" in target.expr


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (deploy/prometheus/install.sh)")
def test_every_expression_is_valid_promql(tmp_path):
    """Each expression, variables substituted, as a recording rule that promtool parses."""
    values = all_values()
    rules = [
        {"record": f"check:{d.uid.replace('-', '_')}:{i}", "expr": substitute(t.expr, values)}
        for d in DASHBOARDS
        for i, (_, t) in enumerate(d.targets())
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_provisioning_points_at_the_dashboards():
    root = OUT_DIR.parent
    ds = yaml.safe_load((root / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    assert ds["datasources"][0]["isDefault"] is True
    prov = yaml.safe_load((root / "provisioning" / "dashboards" / "hybridserve.yaml").read_text())
    assert prov["apiVersion"] == 1 and prov["providers"][0]["type"] == "file"
    assert prov["providers"][0]["options"]["path"]
