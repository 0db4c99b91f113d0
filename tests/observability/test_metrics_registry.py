"""MetricsRegistry: per-replica totals, bucketed observations, router deltas, exposition."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cluster.observability.metrics_registry import MetricsRegistry
from workers.stats import EngineStats


class _Collector:
    def __init__(self, registry: MetricsRegistry) -> None:
        self.registry = registry

    def collect(self):
        return self.registry.collect()


def scrape(registry: MetricsRegistry) -> dict[tuple[str, tuple], float]:
    prom = CollectorRegistry(auto_describe=False)
    prom.register(_Collector(registry))
    text = generate_latest(prom).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def lbl(**labels: str) -> tuple:
    return tuple(sorted(labels.items()))


def engine_stats(tokens: int, ttfts: list[float]) -> EngineStats:
    st = EngineStats()
    st.inc("hybridserve_generation_tokens_total", tokens)
    st.inc("hybridserve_requests_total", 2, label="length")
    st.inc("hybridserve_mamba_checkpoints_inserted_total", 1, label="prefill")
    for t in ttfts:
        st.observe("hybridserve_time_to_first_token_seconds", t)
    st.gauges["hybridserve_num_running_requests"] = 3
    return st


def test_replica_totals_gauges_and_histograms_are_exported_per_replica():
    reg = MetricsRegistry()
    for replica, tokens, ttfts in (("0", 10, [0.003, 0.2]), ("1", 4, [9.0])):
        st = engine_stats(tokens, ttfts)
        reg.update_replica("m", replica, st.snapshot(), st.drain_observations(), now=0)
    got = scrape(reg)
    r0, r1 = lbl(model="m", replica="0"), lbl(model="m", replica="1")
    assert got[("hybridserve_generation_tokens_total", r0)] == 10
    assert got[("hybridserve_generation_tokens_total", r1)] == 4
    assert got[("hybridserve_requests_total", lbl(model="m", replica="0", finish_reason="length"))] == 2
    assert got[("hybridserve_mamba_checkpoints_inserted_total", lbl(model="m", replica="0", phase="prefill"))] == 1
    assert got[("hybridserve_num_running_requests", r0)] == 3
    assert got[("hybridserve_time_to_first_token_seconds_count", r0)] == 2
    assert got[("hybridserve_time_to_first_token_seconds_bucket", lbl(model="m", replica="0", le="0.005"))] == 1
    assert got[("hybridserve_time_to_first_token_seconds_bucket", lbl(model="m", replica="0", le="+Inf"))] == 2
    assert abs(got[("hybridserve_time_to_first_token_seconds_sum", r1)] - 9.0) < 1e-9


def test_counter_pushes_are_totals_and_observations_accumulate():
    reg = MetricsRegistry()
    st = engine_stats(5, [0.1])
    reg.update_replica("m", "0", st.snapshot(), st.drain_observations())
    reg.update_replica("m", "0", st.snapshot(), st.drain_observations())  # same totals again
    st.inc("hybridserve_generation_tokens_total", 7)
    st.observe("hybridserve_time_to_first_token_seconds", 0.2)
    reg.update_replica("m", "0", st.snapshot(), st.drain_observations())
    got = scrape(reg)
    key = lbl(model="m", replica="0")
    assert got[("hybridserve_generation_tokens_total", key)] == 12  # not 5 + 5 + 12
    assert got[("hybridserve_time_to_first_token_seconds_count", key)] == 2


def test_router_deltas_sum_and_silent_replicas_expire():
    reg = MetricsRegistry()
    reg.add_router_decisions("m", {"prefix": 3, "cold": 1})
    reg.add_router_decisions("m", {"prefix": 2})
    reg.update_replica("m", "0", {"hybridserve_generation_tokens_total": 1}, {}, now=0.0)
    reg.update_replica("m", "1", {"hybridserve_generation_tokens_total": 1}, {}, now=50.0)
    assert reg.expire(max_age_s=30, now=60.0) == [("m", "0")]
    got = scrape(reg)
    assert got[("hybridserve_router_decisions_total", lbl(model="m", reason="prefix"))] == 5
    assert got[("hybridserve_router_decisions_total", lbl(model="m", reason="cold"))] == 1
    assert {k[1] for k in got if k[0] == "hybridserve_generation_tokens_total"} == {lbl(model="m", replica="1")}


def test_no_unbounded_labels():
    """Only model, replica and the engine's fixed label sets appear."""
    reg = MetricsRegistry()
    st = engine_stats(1, [0.1])
    reg.update_replica("m", "0", st.snapshot(), st.drain_observations())
    reg.add_router_decisions("m", {"prefix": 1})
    names = {name for key in scrape(reg) for name, _ in key[1]}
    assert names <= {
        "model",
        "replica",
        "finish_reason",
        "phase",
        "path",
        "invariant",
        "le",
        "reason",
        "tier",
        "outcome",
        "direction",
    }


def test_known_label_values_are_exported_at_zero():
    """A counter that must stay 0 still has a series (to graph, to alert on, for rate())."""
    reg = MetricsRegistry()
    st = EngineStats()
    st.inc("hybridserve_mamba_donations_skipped_total", 2, label="decode")
    reg.update_replica("m", "0", st.snapshot(), st.drain_observations())
    got = scrape(reg)
    key = {"model": "m", "replica": "0"}
    assert got[("hybridserve_invariant_violations_total", lbl(**key, invariant="I1"))] == 0
    assert got[("hybridserve_invariant_violations_total", lbl(**key, invariant="I10"))] == 0
    assert got[("hybridserve_mamba_donations_skipped_total", lbl(**key, path="decode"))] == 2
    assert got[("hybridserve_mamba_donations_skipped_total", lbl(**key, path="prefill_finished"))] == 0
    assert got[("hybridserve_mamba_checkpoints_inserted_total", lbl(**key, phase="finish"))] == 0
    assert got[("hybridserve_requests_total", lbl(**key, finish_reason="abort"))] == 0
    assert got[("hybridserve_router_decisions_total", lbl(model="m", reason="fallback"))] == 0
