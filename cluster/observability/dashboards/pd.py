"""The Cluster dashboard's row of prefill/decode disaggregation (``cluster/pd``): how the
ingress routed requests, the hand-offs exported and pulled, their bytes and pull time.
Empty for a colocated app."""

from __future__ import annotations

from cluster.observability.dashboards.model import Panel, Row, Target
from cluster.observability.dashboards.promql import quantile, rate

MODEL = 'model=~"$model"'

PD = Row(
    "Prefill/decode disaggregation",
    (
        Panel(
            "Routes",
            "Requests per second by route: direct (a decode replica's cache left little to compute: a "
            "follow-up turn, a short prompt), prefill (a prefill replica ran the prompt, then handed it "
            "off), fallback (the prefill replica failed or refused: the decode replica prefilled).",
            (Target(rate("hybridserve_pd_requests_total", MODEL, ("route",)), "{{route}}"),),
            unit="reqps",
            width=8,
        ),
        Panel(
            "Hand-offs",
            "Per second: checkpoints prefill replicas exported (no_checkpoint: none to hand off; expired: "
            "never pulled) and pulls by decode replicas by outcome (imported, present; lost, timeout, "
            "invalid, host_full, error each cost a local prefill).",
            (
                Target(rate("hybridserve_pd_handoffs_total", MODEL, ("outcome",)), "export {{outcome}}"),
                Target(rate("hybridserve_pd_transfers_total", MODEL, ("outcome",)), "pull {{outcome}}"),
            ),
            unit="ops",
            width=8,
        ),
        Panel(
            "Hand-off bytes and pull time",
            "Bytes per second decode replicas imported, and the p50 / p99 time of a pull.",
            (
                Target(rate("hybridserve_pd_transfer_bytes_total", MODEL), "bytes/s"),
                Target(quantile(0.5, "hybridserve_pd_transfer_seconds", MODEL), "p50 pull s"),
                Target(quantile(0.99, "hybridserve_pd_transfer_seconds", MODEL), "p99 pull s"),
            ),
            width=8,
        ),
    ),
)
