"""Engine counters as plain data (DESIGN §4.4). Only cluster/ turns them into Prometheus.

Keys are the Prometheus names. A labelled counter maps label value -> count; a histogram
keeps every observation since the last ``drain_observations`` (the cluster drains them
into real histograms) plus running count and sum.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

COUNTERS = (
    "hybridserve_mamba_donations_total",
    "hybridserve_mamba_pending_alloc_failures_total",
    "hybridserve_mamba_inplace_track_writes_total",
    "hybridserve_mamba_checkpoints_evicted_total",
    "hybridserve_mamba_duplicate_inserts_total",
    "hybridserve_prefix_query_tokens_total",
    "hybridserve_prefix_hit_tokens_total",
    "hybridserve_spec_draft_tokens_total",
    "hybridserve_spec_accepted_tokens_total",
    "hybridserve_preemptions_total",
    "hybridserve_prompt_tokens_total",
    "hybridserve_generation_tokens_total",
    "hybridserve_forward_tokens_total",  # tokens fed to forwards (with step durations: a rate)
    "hybridserve_overlapped_steps_total",  # steps launched while the step before was in flight
    "hybridserve_compile_recompiles_total",  # compiled calls that compiled a graph after the warm-up
    "hybridserve_invariant_checks_total",  # debug.check_invariants: steps checked
    "hybridserve_state_oracle_checks_total",  # debug.state_oracle_sample: checkpoints recomputed
    "hybridserve_state_oracle_mismatches_total",  # ... whose slot did not hold that state
    "hybridserve_pd_transfer_bytes_total",  # PD: checkpoint bytes a decode replica imported
)
LABELLED_COUNTERS = {
    "hybridserve_mamba_donations_skipped_total": "path",
    "hybridserve_mamba_checkpoints_inserted_total": "phase",
    "hybridserve_invariant_violations_total": "invariant",
    "hybridserve_requests_total": "finish_reason",
    "hybridserve_engine_steps_total": "path",  # compiled (a compile.* bucket) or eager
    # The tiers (workers/tiers): device -> host, host -> device, the cluster store (the
    # outcomes and directions: LABEL_VALUES below).
    "hybridserve_cache_hits_total": "tier",  # requests whose prompt hit, by deepest tier
    "hybridserve_cache_hit_tokens_total": "tier",  # ... and the prompt tokens it served
    "hybridserve_tier_demotions_total": "outcome",
    "hybridserve_tier_promotions_total": "outcome",
    "hybridserve_tier_bytes_total": "direction",
    "hybridserve_store_fetches_total": "outcome",
    "hybridserve_store_commits_total": "outcome",
    # Prefill/decode disaggregation (cluster/pd): hand-offs exported (prefill replicas) and
    # taken (decode replicas; anything but ``imported`` / ``present`` means a local prefill).
    "hybridserve_pd_handoffs_total": "outcome",
    "hybridserve_pd_transfers_total": "outcome",
}
# Fixed label values of the labelled counters above (exported at 0 until counted).
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "hybridserve_engine_steps_total": ("compiled", "eager"),
    "hybridserve_cache_hits_total": ("device", "host", "store"),
    "hybridserve_cache_hit_tokens_total": ("device", "host", "store"),
    "hybridserve_tier_demotions_total": ("demoted", "copied", "present", "host_full", "failed"),
    "hybridserve_tier_promotions_total": ("promoted", "failed"),
    "hybridserve_tier_bytes_total": ("device_to_host", "host_to_device", "store_put", "store_get"),
    "hybridserve_store_fetches_total": ("fetched", "recomputed", "present", "lost", "invalid", "host_full", "error"),
    "hybridserve_store_commits_total": ("committed", "duplicate", "error"),
    "hybridserve_pd_handoffs_total": ("exported", "no_checkpoint", "expired"),
    "hybridserve_pd_transfers_total": ("imported", "present", "invalid", "host_full", "lost", "timeout", "error"),
}
HISTOGRAMS = (
    "hybridserve_time_to_first_token_seconds",
    "hybridserve_time_per_output_token_seconds",
    "hybridserve_e2e_request_latency_seconds",
    "hybridserve_step_duration_seconds",
    "hybridserve_step_gap_seconds",
    "hybridserve_pd_transfer_seconds",  # PD: a decode replica's pull of a hand-off
)
GAUGES = (
    "hybridserve_num_running_requests",
    "hybridserve_num_waiting_requests",
    "hybridserve_kv_pool_usage_ratio",
    "hybridserve_mamba_pool_usage_ratio",
    "hybridserve_host_mamba_slots_used",  # host tier: checkpoints held in host memory
    "hybridserve_host_kv_tokens_used",  # ... KV tokens held there
    "hybridserve_host_kv_dead_tokens",  # ... of which with no checkpoint under them (must be 0)
)
# Pushed by the cluster store's actor (cluster/store), one series per app (replica "store").
STORE_GAUGES = ("hybridserve_store_objects", "hybridserve_store_bytes")
STORE_COUNTERS = ("hybridserve_store_evictions_total",)


@dataclass
class EngineStats:
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    labelled: dict[str, dict[str, int]] = field(
        default_factory=lambda: {name: defaultdict(int) for name in LABELLED_COUNTERS}
    )
    observations: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in HISTOGRAMS})
    totals: dict[str, tuple[int, float]] = field(default_factory=lambda: dict.fromkeys(HISTOGRAMS, (0, 0.0)))
    gauges: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GAUGES, 0.0))

    def inc(self, name: str, amount: int = 1, label: str | None = None) -> None:
        if label is None:
            self.counters[name] += amount
        else:
            self.labelled[name][label] += amount

    def observe(self, name: str, value: float) -> None:
        obs = self.observations[name]
        obs.append(value)
        if len(obs) > 100_000:  # bounded if nobody drains
            del obs[: len(obs) // 2]
        count, total = self.totals[name]
        self.totals[name] = (count + 1, total + value)

    def drain_observations(self) -> dict[str, list[float]]:
        out = {k: v for k, v in self.observations.items()}
        self.observations = {name: [] for name in HISTOGRAMS}
        return out

    def snapshot(self) -> dict[str, object]:
        """The dict ``LLM.stats()`` returns."""
        out: dict[str, object] = dict(self.counters)
        out.update({k: dict(v) for k, v in self.labelled.items()})
        out.update({k: {"count": c, "sum": s} for k, (c, s) in self.totals.items()})
        out.update(self.gauges)
        return out
