"""The serving sections of the schema: ``router``, ``replica``, ``ingress``.

They configure the Ray Serve app (``cluster/app.py``) around the engines; the cluster's
own settings classes (``RouterSettings``, ``FetchSettings``, ``ServerSettings``) are views
built from these, so each setting is validated and described here only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from configs.base import Frozen


class RouterConfig(Frozen):
    """``HybridPrefixRouter``: which replica serves a request (``cluster/routing``)."""

    policy: Literal["hybrid_prefix", "pow2", "round_robin"] = Field(
        "hybrid_prefix", description="routing policy: cached prefix against load, power of two, or round robin"
    )
    load_penalty_tokens: float = Field(
        16.0, ge=0, description="prefill tokens one ongoing request costs a newcomer (the learnt penalty's floor)"
    )
    load_penalty_auto: bool = Field(
        True, description="learn the cost of a queued request from the prefill routed requests compute"
    )
    imbalance_abs: int = Field(
        8, ge=0, description="route to the least loaded replica when the preferred one has this many more requests"
    )
    imbalance_rel: float = Field(
        1.5, ge=1.0, description="... and more than this factor times the least loaded one's requests"
    )
    min_match_tokens: int = Field(
        16, ge=1, description="cached tokens a replica must be expected to save for a prefix decision"
    )
    host_hit_value: float = Field(
        0.9, ge=0, le=1, description="what a host-tier token saves, as a fraction of a device-cached one"
    )
    store_hit_value: float = Field(
        0.5, ge=0, le=1, description="what a cluster-store token saves, as a fraction of a device-cached one"
    )
    store_min_gain_tokens: int = Field(
        0, ge=0, description="tokens a store entry must be deeper than a replica's own to count (fetch break-even)"
    )
    replica_capacity: int = Field(
        0, ge=0, description="requests a replica runs at once; 0: the engine's scheduler.max_running_requests"
    )
    index_timeout_s: float = Field(
        0.5, gt=0, description="how long a decision waits for the prefix index before power of two"
    )
    push_interval_s: float = Field(1.0, gt=0, description="seconds between the router's metric pushes")

    @model_validator(mode="after")
    def _tier_values_ordered(self) -> RouterConfig:
        if self.store_hit_value > self.host_hit_value:
            raise ValueError(
                f"router.store_hit_value ({self.store_hit_value}) must be <= "
                f"router.host_hit_value ({self.host_hit_value})"
            )
        return self


class ReplicaConfig(Frozen):
    """Each engine replica: Serve's limits and resources, publishing, stream pacing, and the
    cluster store's fetch-or-recompute priors (``cluster/serving/replica.py``)."""

    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per engine replica (per rank with TP)")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per replica, to pin replicas to nodes (TP = 1)"
    )
    max_ongoing_requests: int = Field(256, ge=1, description="generate streams a replica runs at once")
    max_queued_requests: int = Field(
        512, ge=-1, description="more waiting per caller's handle, beyond which the ingress answers 503; -1: unbounded"
    )
    stats_interval_s: float = Field(1.0, gt=0, description="seconds between stats pushes and router heartbeats")
    events_interval_s: float = Field(0.05, gt=0, description="seconds between checkpoint-event pushes to the router")
    health_check_period_s: float = Field(10.0, gt=0, description="seconds between Serve's health checks")
    health_check_timeout_s: float = Field(30.0, gt=0, description="a health check slower than this fails")
    graceful_shutdown_wait_loop_s: float = Field(
        2.0, gt=0, description="how often a draining replica checks for finished streams"
    )
    graceful_shutdown_timeout_s: float = Field(
        20.0, ge=0, description="how long a draining replica lets its streams finish"
    )
    stream_interval_s: float = Field(
        0.05, ge=0, description="least seconds between two items of a stream; 0: an item every engine step"
    )
    stream_items_per_s: float = Field(
        100.0, ge=0, description="most stream items per second a replica sends, all streams together; 0: no budget"
    )
    max_stream_interval_s: float = Field(
        0.25, ge=0, description="most seconds between two items of a stream under the budget"
    )
    forget_after_s: float = Field(30.0, gt=0, description="the router index forgets a replica silent for this long")
    store_bandwidth_bytes_per_s: float = Field(
        1e9, gt=0, description="prior of the store's fetch bandwidth (then measured)"
    )
    store_latency_s: float = Field(0.002, ge=0, description="a store fetch's fixed cost")
    prefill_tokens_per_s: float = Field(
        2000.0, gt=0, description="prior of the engine's prefill throughput (then measured)"
    )
    store_fetch_timeout_s: float = Field(10.0, gt=0, description="a store fetch slower than this is abandoned")


class IngressConfig(Frozen):
    """The HTTP ingress deployment: size, Serve's limits, admission, graceful shutdown.

    ``max_in_flight`` (per ingress replica, ``cluster/api/admission.py``) must stay below
    ``max_ongoing_requests`` so that excess requests reach the ingress and get an OpenAI
    503 instead of queuing in the Serve proxy (whose own 503 is plain text).
    """

    num_replicas: int = Field(1, ge=1, description="ingress replicas")
    num_cpus: float = Field(0.0, ge=0, description="Ray CPUs reserved per ingress replica")
    resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per ingress replica, to pin it to nodes"
    )
    max_ongoing_requests: int = Field(1000, ge=1, description="Serve's limit of requests per ingress replica")
    max_queued_requests: int = Field(
        256, ge=-1, description="requests queued in the Serve proxy beyond that (plain-text 503); -1: unbounded"
    )
    max_in_flight: int = Field(
        512, ge=1, description="requests an ingress replica admits; beyond: OpenAI 503 with Retry-After"
    )
    retry_after_s: int = Field(1, ge=0, description="the Retry-After of that 503")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1, description="larger request bodies get a 413")
    max_stream_resumes: int = Field(
        3, ge=0, description="times a request's stream is resumed on another replica after its replica failed"
    )
    resume_timeout_s: float = Field(
        30.0, gt=0, description="how long a resume looks for a replica that accepts it; then an error event"
    )
    graceful_shutdown_wait_loop_s: float = Field(
        2.0, gt=0, description="how often a draining ingress checks for finished requests"
    )
    graceful_shutdown_timeout_s: float = Field(
        20.0, ge=0, description="how long a draining ingress (and hybridserve serve) waits for requests"
    )

    @model_validator(mode="after")
    def _admission_below_serve_limit(self) -> IngressConfig:
        if self.max_in_flight >= self.max_ongoing_requests:
            raise ValueError(
                f"ingress.max_in_flight ({self.max_in_flight}) must be below "
                f"ingress.max_ongoing_requests ({self.max_ongoing_requests})"
            )
        return self


class PDConfig(Frozen):
    """Prefill/decode disaggregation (``cluster/pd``): both replica counts 0 = colocated
    engines (``parallel.num_replicas``); both > 0 = a prefill and a decode deployment behind
    one ingress. A request goes to a decode replica directly when the best decode replica's
    cache leaves at most ``max_local_prefill_tokens`` of its prompt to compute (a follow-up
    turn, a short prompt), else a prefill replica runs its prompt to the first token and the
    decode replica continues from the prompt's checkpoint, pulled from the prefill replica."""

    prefill_replicas: int = Field(0, ge=0, description="prefill engine replicas; 0 (with decode_replicas 0): colocated")
    decode_replicas: int = Field(0, ge=0, description="decode engine replicas; 0 (with prefill_replicas 0): colocated")
    max_local_prefill_tokens: int = Field(
        64, ge=0, description="uncached prompt tokens a decode replica computes itself instead of a prefill hop"
    )
    transfer_timeout_s: float = Field(
        10.0, gt=0, description="how long a decode replica waits for a hand-off; then it prefills the prompt itself"
    )
    handoff_ttl_s: float = Field(
        30.0, gt=0, description="how long a prefill replica keeps a hand-off no decode replica has taken"
    )

    @property
    def enabled(self) -> bool:
        return self.prefill_replicas > 0 or self.decode_replicas > 0

    @model_validator(mode="after")
    def _both_or_neither(self) -> PDConfig:
        if (self.prefill_replicas > 0) != (self.decode_replicas > 0):
            raise ValueError(
                f"pd.prefill_replicas ({self.prefill_replicas}) and pd.decode_replicas ({self.decode_replicas}) "
                "must both be 0 (colocated) or both > 0"
            )
        return self
