"""Aggregates the replicas' engine stats into Prometheus families (no Ray; plain class).

How numbers arrive (DESIGN §4.4 names, labels ``model`` and ``replica``):
- Replica counters arrive as the replica's CUMULATIVE totals (``EngineStats.snapshot()``)
  and are exported as they are, one series per replica. A push is idempotent, a lost push
  costs nothing, and a restarted replica reporting smaller totals is an ordinary counter
  reset that ``rate()`` handles.
- Gauges arrive as the latest value per replica.
- Histograms arrive as the observations drained since the previous push
  (``EngineStats.drain_observations()``) and are bucketed here, cumulatively.
- Router decisions arrive as DELTAS from each router (routers have no stable identity),
  summed per ``model`` and ``reason``.

Cardinality is bounded: ``replica`` is the replica's rank (or short id), label values of
labelled counters come from the engine's fixed sets, never request ids or prompt text.
Every known value of those sets (``LABEL_VALUES``, ``REASONS``) is exported at 0 until
counted, so a counter that must stay 0 (invariant violations) still has a series to
graph and alert on, and ``rate()`` sees the first increment.
Replicas silent for ``max_age_s`` are dropped by ``expire``. Thread-safe: pushes come
from the actor's thread, ``collect`` from the HTTP server's.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from cluster.routing.routing_policy import REASONS
from workers.request import FinishReason
from workers.stats import LABEL_VALUES as TIER_LABEL_VALUES
from workers.stats import LABELLED_COUNTERS

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BUCKETS = {
    "hybridserve_time_to_first_token_seconds": LATENCY_BUCKETS,
    "hybridserve_time_per_output_token_seconds": STEP_BUCKETS + (5.0,),
    "hybridserve_e2e_request_latency_seconds": LATENCY_BUCKETS + (320.0, 640.0),
    "hybridserve_step_duration_seconds": STEP_BUCKETS,
    "hybridserve_step_gap_seconds": STEP_BUCKETS,
    "hybridserve_pd_transfer_seconds": STEP_BUCKETS + (5.0, 10.0),
}
ROUTER_DECISIONS = "hybridserve_router_decisions_total"
# The ingresses' stream resumes (``cluster/api/resumable.py``), summed per model; the
# failures labelled by ``reason``.
STREAM_MIGRATIONS = "hybridserve_stream_migrations_total"
STREAM_RETRIES = "hybridserve_stream_retries_total"
STREAM_RESUME_FAILURES = "hybridserve_stream_resume_failures_total"
RESUME_FAILURE_REASONS = ("exhausted", "timeout", "refused")
# Prefill/decode disaggregation (``cluster/pd``): how the ingress routed each request.
PD_REQUESTS = "hybridserve_pd_requests_total"
PD_ROUTES = ("direct", "prefill", "fallback")
# The label of each labelled ingress counter.
INGRESS_LABELS = {STREAM_RESUME_FAILURES: "reason", PD_REQUESTS: "route"}
# The engine's fixed label sets (workers/cache/checkpoints.py, workers/cache/records.py,
# workers/request.py, the tiers' in workers/stats.py); values outside them are still
# exported when counted.
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "hybridserve_mamba_donations_skipped_total": (
        "prefill_finished",
        "prefill_unfinished",
        "decode_finished",
        "decode",
    ),
    "hybridserve_mamba_checkpoints_inserted_total": ("prefill", "decode", "finish"),
    "hybridserve_invariant_violations_total": tuple(f"I{i}" for i in range(1, 11)),
    "hybridserve_requests_total": tuple(r.value for r in FinishReason),
    **TIER_LABEL_VALUES,
}


@dataclass
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int]  # per bucket (not cumulative); last = +Inf
    total: float = 0.0

    @classmethod
    def empty(cls, bounds: Sequence[float]) -> _Histogram:
        return cls(tuple(bounds), [0] * (len(bounds) + 1))

    def observe_many(self, values: Sequence[float]) -> None:
        for v in values:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.total += v

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass
class _ReplicaSeries:
    counters: dict[str, float] = field(default_factory=dict)
    labelled: dict[str, dict[str, float]] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, _Histogram] = field(default_factory=dict)
    last_push: float = 0.0


class MetricsRegistry:
    def __init__(self, buckets: Mapping[str, Sequence[float]] | None = None) -> None:
        self._buckets = dict(BUCKETS if buckets is None else buckets)
        self._replicas: dict[tuple[str, str], _ReplicaSeries] = {}
        self._decisions: dict[tuple[str, str], float] = {}
        self._ingress: dict[tuple[str, str, str], float] = {}  # (model, name, label or "")
        self._lock = threading.Lock()

    def update_replica(
        self,
        model: str,
        replica: str,
        snapshot: Mapping[str, object],
        observations: Mapping[str, Sequence[float]],
        now: float | None = None,
    ) -> None:
        with self._lock:
            series = self._replicas.setdefault((model, replica), _ReplicaSeries())
            series.last_push = time.monotonic() if now is None else now
            for name, value in snapshot.items():
                _absorb(series, name, value)
            for name, values in observations.items():
                hist = series.histograms.get(name)
                if hist is None:
                    buckets = self._buckets.get(name, LATENCY_BUCKETS)
                    hist = series.histograms[name] = _Histogram.empty(buckets)
                hist.observe_many(values)

    def add_router_decisions(self, model: str, deltas: Mapping[str, int]) -> None:
        with self._lock:
            for reason, n in deltas.items():
                key = (model, reason)
                self._decisions[key] = self._decisions.get(key, 0) + n

    def add_ingress_count(self, model: str, name: str, label: str | None = None) -> None:
        with self._lock:
            key = (model, name, label or "")
            self._ingress[key] = self._ingress.get(key, 0) + 1

    def forget_replica(self, model: str, replica: str) -> None:
        with self._lock:
            self._replicas.pop((model, replica), None)

    def expire(self, max_age_s: float, now: float | None = None) -> list[tuple[str, str]]:
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [k for k, s in self._replicas.items() if now - s.last_push > max_age_s]
            for key in old:
                del self._replicas[key]
        return old

    def replicas(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._replicas)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            families = self._families()
        yield from families

    def _families(self) -> list[Metric]:
        fams: dict[str, Metric] = {}
        base = ["model", "replica"]
        for (model, replica), s in sorted(self._replicas.items()):
            for name, v in s.counters.items():
                _family(fams, name, CounterMetricFamily, base).add_metric([model, replica], v)
            for name, by_label in s.labelled.items():
                label = LABELLED_COUNTERS.get(name, "label")
                fam = _family(fams, name, CounterMetricFamily, base + [label])
                for value, n in sorted(by_label.items()):
                    fam.add_metric([model, replica, value], n)
            for name, v in s.gauges.items():
                _family(fams, name, GaugeMetricFamily, base).add_metric([model, replica], v)
            for name, h in s.histograms.items():
                _family(fams, name, HistogramMetricFamily, base).add_metric([model, replica], h.buckets(), h.total)
        decisions = dict.fromkeys(((m, r) for m, _ in self._replicas for r in REASONS), 0.0)
        decisions.update(self._decisions)
        if decisions:
            fam = _family(fams, ROUTER_DECISIONS, CounterMetricFamily, ["model", "reason"])
            for (model, reason), n in sorted(decisions.items()):
                fam.add_metric([model, reason], n)
        self._ingress_families(fams)
        return list(fams.values())

    def _ingress_families(self, fams: dict[str, Metric]) -> None:
        """The ingresses' counters of every model seen, at 0 until counted (the PD routes
        once a model's ingress has routed one request)."""
        models = {m for m, _ in self._replicas} | {m for m, _, _ in self._ingress}
        counts = {(m, n, ""): 0.0 for m in models for n in (STREAM_MIGRATIONS, STREAM_RETRIES)}
        counts.update({(m, STREAM_RESUME_FAILURES, r): 0.0 for m in models for r in RESUME_FAILURE_REASONS})
        pd_models = {m for m, n, _ in self._ingress if n == PD_REQUESTS}  # only apps that disaggregate
        counts.update({(m, PD_REQUESTS, r): 0.0 for m in pd_models for r in PD_ROUTES})
        counts.update(self._ingress)
        for (model, name, label), n in sorted(counts.items()):
            key = INGRESS_LABELS.get(name)
            fam = _family(fams, name, CounterMetricFamily, ["model", key] if key else ["model"])
            fam.add_metric([model, label] if key else [model], n)


def _absorb(series: _ReplicaSeries, name: str, value: object) -> None:
    """File one ``EngineStats.snapshot()`` entry by its shape and name."""
    if isinstance(value, bool) or not name.startswith("hybridserve_"):
        return
    if isinstance(value, Mapping):
        if "count" in value and "sum" in value:
            return  # histogram totals: bucketed from observations
        counts = dict.fromkeys(LABEL_VALUES.get(name, ()), 0.0)
        counts.update({str(k): float(v) for k, v in value.items()})  # type: ignore[arg-type]
        series.labelled[name] = counts
    elif isinstance(value, int) and name.endswith("_total"):
        series.counters[name] = float(value)
    elif isinstance(value, (int, float)):
        series.gauges[name] = float(value)


def _family(fams: dict[str, Metric], name: str, kind: type, labels: list[str]) -> Metric:
    fam = fams.get(name)
    if fam is None:
        fam = fams[name] = kind(name, _doc(name), labels=labels)
    return fam


def _doc(name: str) -> str:
    return "hybridserve " + name.removeprefix("hybridserve_").replace("_", " ")


class PrometheusCollector:
    """A ``MetricsRegistry`` as a ``prometheus_client`` collector."""

    def __init__(self, registry: MetricsRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        return self._registry.collect()


def prometheus_registry(registry: MetricsRegistry) -> CollectorRegistry:
    prom = CollectorRegistry(auto_describe=False)
    prom.register(PrometheusCollector(registry))  # type: ignore[arg-type]
    return prom


def render_text(prom: CollectorRegistry) -> str:
    """The Prometheus text exposition of ``prom`` (what ``/metrics`` serves)."""
    return generate_latest(prom).decode()
