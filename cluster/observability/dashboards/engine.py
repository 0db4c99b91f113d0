"""The Engine dashboard: what each replica's engine is doing (``hybridserve_*`` only).

Every query is filtered by the ``model`` and ``replica`` variables, so choosing one
replica shows that replica alone; series are split by ``replica`` where comparing
replicas is the point.
"""

from __future__ import annotations

from cluster.observability.dashboards.model import Dashboard, Panel, Row, Target, Variable
from cluster.observability.dashboards.promql import gauge, quantile, rate, ratio
from cluster.observability.dashboards.tiers import TIERS

SEL = 'model=~"$model", replica=~"$replica"'
PERCENTILES = (0.5, 0.9, 0.99)


def _percentiles(title: str, histogram: str, description: str) -> Panel:
    targets = tuple(Target(quantile(q, histogram, SEL), f"p{round(q * 100)}") for q in PERCENTILES)
    return Panel(title, description, targets, unit="s", width=8)


LATENCY = Row(
    "Latency",
    (
        _percentiles(
            "Time to first token",
            "hybridserve_time_to_first_token_seconds",
            "TTFT percentiles over the selected replicas: arrival of a request to its first "
            "output token (queueing and prefill included).",
        ),
        _percentiles(
            "Time per output token",
            "hybridserve_time_per_output_token_seconds",
            "TPOT percentiles: decode time per output token after the first, per request (vLLM's definition).",
        ),
        _percentiles(
            "End-to-end request latency",
            "hybridserve_e2e_request_latency_seconds",
            "E2E percentiles: arrival of a request to its last token.",
        ),
    ),
)

THROUGHPUT = Row(
    "Throughput and scheduling",
    (
        Panel(
            "Request throughput",
            "Finished requests per second, by replica and finish reason (stop, length, abort).",
            (
                Target(
                    rate("hybridserve_requests_total", SEL, ("replica", "finish_reason")),
                    "{{replica}} {{finish_reason}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Token throughput",
            "Prompt tokens prefilled and tokens generated per second, by replica.",
            (
                Target(rate("hybridserve_prompt_tokens_total", SEL, ("replica",)), "prompt {{replica}}"),
                Target(rate("hybridserve_generation_tokens_total", SEL, ("replica",)), "generation {{replica}}"),
            ),
            unit="short",
        ),
        Panel(
            "Running and waiting requests",
            "Requests in the running batch and in the waiting queue, "
            "by replica. A growing queue with a full running set means the replica is saturated.",
            (
                Target(gauge("hybridserve_num_running_requests", SEL, ("replica",)), "running {{replica}}"),
                Target(gauge("hybridserve_num_waiting_requests", SEL, ("replica",)), "waiting {{replica}}"),
            ),
        ),
        Panel(
            "Preemptions",
            "Running requests pushed back to the queue per second (pools full), "
            "by replica. Sustained preemption means the pools are too small for the load.",
            (Target(rate("hybridserve_preemptions_total", SEL, ("replica",)), "{{replica}}"),),
            unit="ops",
        ),
        Panel(
            "Engine step time and idle gap",
            "Forward step duration and the executor's idle gap between "
            "steps (p50, p99). The overlap scheduler exists to keep the gap near zero.",
            (
                Target(quantile(0.5, "hybridserve_step_duration_seconds", SEL), "step p50"),
                Target(quantile(0.99, "hybridserve_step_duration_seconds", SEL), "step p99"),
                Target(quantile(0.5, "hybridserve_step_gap_seconds", SEL), "gap p50"),
                Target(quantile(0.99, "hybridserve_step_gap_seconds", SEL), "gap p99"),
            ),
            unit="s",
            width=16,
        ),
        Panel(
            "Compiled and eager steps",
            "Engine steps per second by path, by replica: compiled (a "
            "compile.batch_sizes bucket: decode, verify) or eager (prefill, mixed, above the largest "
            "bucket). Decode steps running eager with compilation on cost their compiled speed.",
            (Target(rate("hybridserve_engine_steps_total", SEL, ("replica", "path")), "{{path}} {{replica}}"),),
            unit="ops",
            width=8,
        ),
    ),
)

POOLS = Row(
    "Pools and prefix cache",
    (
        Panel(
            "KV and Mamba pool usage",
            "Fraction of KV pages and of Mamba state slots in use (running "
            "requests plus cached checkpoints), by replica.",
            (
                Target(gauge("hybridserve_kv_pool_usage_ratio", SEL, ("replica",)), "KV {{replica}}"),
                Target(gauge("hybridserve_mamba_pool_usage_ratio", SEL, ("replica",)), "Mamba {{replica}}"),
            ),
            unit="percentunit",
            max=1.0,
            width=8,
        ),
        Panel(
            "Prefix cache hit ratio",
            "Prompt tokens served from the cache / prompt tokens looked up, "
            "as a ratio of rates over the window, by replica. Hits count only up to the deepest "
            "usable Mamba checkpoint.",
            (
                Target(
                    ratio(
                        rate("hybridserve_prefix_hit_tokens_total", SEL, ("replica",)),
                        rate("hybridserve_prefix_query_tokens_total", SEL, ("replica",)),
                    ),
                    "{{replica}}",
                ),
            ),
            unit="percentunit",
            max=1.0,
            width=8,
        ),
        Panel(
            "Prefix tokens looked up and hit",
            "The two counters behind the hit ratio, in tokens per second.",
            (
                Target(rate("hybridserve_prefix_query_tokens_total", SEL, ("replica",)), "looked up {{replica}}"),
                Target(rate("hybridserve_prefix_hit_tokens_total", SEL, ("replica",)), "hit {{replica}}"),
            ),
            width=8,
        ),
    ),
)

CHECKPOINTS = Row(
    "Mamba checkpoints",
    (
        Panel(
            "Checkpoints inserted and evicted",
            "Mamba checkpoints added to the radix tree per second by "
            "phase (prefill, decode, finish), freed by eviction, and inserts that found one already there.",
            (
                Target(rate("hybridserve_mamba_checkpoints_inserted_total", SEL, ("phase",)), "inserted {{phase}}"),
                Target(rate("hybridserve_mamba_checkpoints_evicted_total", SEL), "evicted"),
                Target(rate("hybridserve_mamba_duplicate_inserts_total", SEL), "duplicate inserts"),
            ),
        ),
        Panel(
            "Donations made and skipped",
            "Keep slots handed to the tree without a copy, and donations "
            "skipped because the slot still had a pending writer, by path. Skips are normal under the "
            "overlap scheduler; skips rising together with allocation failures are an alarm.",
            (
                Target(rate("hybridserve_mamba_donations_total", SEL), "made"),
                Target(rate("hybridserve_mamba_donations_skipped_total", SEL, ("path",)), "skipped {{path}}"),
            ),
        ),
        Panel(
            "Pending-slot allocation failures",
            "Optional (non-evicting) track-slot allocations that "
            "failed per second, by replica: each one skips a checkpoint, never a request.",
            (Target(rate("hybridserve_mamba_pending_alloc_failures_total", SEL, ("replica",)), "{{replica}}"),),
            unit="ops",
        ),
        Panel(
            "In-place track writes",
            "Boundary states written in place into the keep slot (the "
            "lazy strategy's fallback when no second slot could be borrowed), by replica.",
            (Target(rate("hybridserve_mamba_inplace_track_writes_total", SEL, ("replica",)), "{{replica}}"),),
            unit="ops",
        ),
    ),
)

CORRECTNESS = Row(
    "Correctness and speculation",
    (
        Panel(
            "Invariant violations",
            "Cache invariant violations counted by debug.check_invariants since "
            "the replicas started. Must be 0; anything else is a bug to report.",
            (Target(gauge("hybridserve_invariant_violations_total", SEL)),),
            kind="stat",
            alarm_at=1,
            width=6,
        ),
        Panel(
            "Invariant violations by invariant",
            "Violations per second by invariant (I1..I10); flat at 0 unless something is wrong.",
            (Target(rate("hybridserve_invariant_violations_total", SEL, ("invariant",)), "{{invariant}}"),),
            unit="ops",
            width=9,
        ),
        Panel(
            "Speculative acceptance rate",
            "Draft tokens accepted / draft tokens proposed, by replica (empty while speculation is off).",
            (
                Target(
                    ratio(
                        rate("hybridserve_spec_accepted_tokens_total", SEL, ("replica",)),
                        rate("hybridserve_spec_draft_tokens_total", SEL, ("replica",)),
                    ),
                    "{{replica}}",
                ),
            ),
            unit="percentunit",
            max=1.0,
            width=9,
        ),
    ),
)

ENGINE = Dashboard(
    uid="hybridserve-engine",
    title="hybridserve / Engine",
    description="Per-replica engine metrics of hybridserve (latency, throughput, pools, "
    "prefix cache, Mamba checkpoints, checkpoint tiers, invariants, speculation).",
    rows=(LATENCY, THROUGHPUT, POOLS, CHECKPOINTS, TIERS, CORRECTNESS),
    variables=(
        Variable("model", "Model", "label_values(hybridserve_num_running_requests, model)"),
        Variable("replica", "Replica", 'label_values(hybridserve_num_running_requests{model=~"$model"}, replica)'),
    ),
)
