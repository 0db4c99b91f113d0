"""Dashboard rows of the checkpoint tiers: the engine's host tier and transfers
(``TIERS``, on the Engine dashboard, filtered by model and replica) and the cluster store
(``STORE``, on the Cluster dashboard; the store's actor reports as ``replica="store"``)."""

from __future__ import annotations

from cluster.observability.dashboards.model import Panel, Row, Target
from cluster.observability.dashboards.promql import gauge, rate

ENGINE_SEL = 'model=~"$model", replica=~"$replica"'
STORE_SEL = 'model=~"$model", replica="store"'

TIERS = Row(
    "Checkpoint tiers",
    (
        Panel(
            "Cache hits by tier",
            "Requests per second whose prompt resumed from a checkpoint, by the "
            "tier it came from: device (the radix tree), host (promoted from the host tier), store "
            "(fetched from the cluster store, then promoted).",
            (Target(rate("hybridserve_cache_hits_total", ENGINE_SEL, ("tier",)), "{{tier}}"),),
            unit="reqps",
            width=8,
        ),
        Panel(
            "Hit tokens by tier",
            "Prompt tokens per second served from each tier (not recomputed).",
            (Target(rate("hybridserve_cache_hit_tokens_total", ENGINE_SEL, ("tier",)), "{{tier}}"),),
            width=8,
        ),
        Panel(
            "Promotions and demotions",
            "Checkpoints copied device -> host per second by outcome "
            "(demoted on eviction, copied for the store, present already, host_full: dropped, failed) "
            "and host -> device (promoted, failed). Failures only cost a recompute.",
            (
                Target(rate("hybridserve_tier_demotions_total", ENGINE_SEL, ("outcome",)), "demote {{outcome}}"),
                Target(rate("hybridserve_tier_promotions_total", ENGINE_SEL, ("outcome",)), "promote {{outcome}}"),
            ),
            unit="ops",
            width=8,
        ),
        Panel(
            "Bytes moved between tiers",
            "Bytes per second copied device -> host, host -> device, and put into / fetched from the cluster store.",
            (Target(rate("hybridserve_tier_bytes_total", ENGINE_SEL, ("direction",)), "{{direction}}"),),
            unit="Bps",
            width=8,
        ),
        Panel(
            "Host tier usage",
            "Checkpoints and KV tokens held in each replica's host tier.",
            (
                Target(gauge("hybridserve_host_mamba_slots_used", ENGINE_SEL, ("replica",)), "checkpoints {{replica}}"),
                Target(gauge("hybridserve_host_kv_tokens_used", ENGINE_SEL, ("replica",)), "KV tokens {{replica}}"),
            ),
            width=8,
        ),
        Panel(
            "Host KV with no checkpoint under it",
            "KV tokens in the host tier that no host checkpoint "
            "can use (SGLang's 'dead memory'). Must be 0: every host leaf holds a checkpoint.",
            (Target(gauge("hybridserve_host_kv_dead_tokens", ENGINE_SEL)),),
            kind="stat",
            alarm_at=1,
            width=8,
        ),
        Panel(
            "Store fetches and commits",
            "Per second: fetch decisions by outcome (fetched, recomputed: the "
            "cost model preferred prefill, present, lost: its node died, invalid, host_full, error) and "
            "commits by outcome (committed, duplicate, error).",
            (
                Target(rate("hybridserve_store_fetches_total", ENGINE_SEL, ("outcome",)), "fetch {{outcome}}"),
                Target(rate("hybridserve_store_commits_total", ENGINE_SEL, ("outcome",)), "commit {{outcome}}"),
            ),
            unit="ops",
            width=24,
        ),
    ),
)

STORE = Row(
    "Cluster checkpoint store",
    (
        Panel(
            "Store objects",
            "Checkpoints held in the cluster store (Ray's object store), cluster-wide.",
            (Target(gauge("hybridserve_store_objects", STORE_SEL)),),
            width=8,
        ),
        Panel(
            "Store bytes",
            "Bytes of those checkpoints (state + the KV of their paths), against the cache.cluster_store_bytes budget.",
            (Target(gauge("hybridserve_store_bytes", STORE_SEL)),),
            unit="bytes",
            width=8,
        ),
        Panel(
            "Store evictions",
            "Checkpoints the store evicted per second to stay within its budget.",
            (Target(rate("hybridserve_store_evictions_total", STORE_SEL)),),
            unit="ops",
            width=8,
        ),
    ),
)
