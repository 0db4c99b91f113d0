"""hybridserve's Grafana dashboards as code (``model``: the tiny dashboard model;
``engine``, ``cluster``: the two dashboards; ``writer``: renders them into
``deploy/grafana/dashboards/``). Regenerate with ``python -m cluster.observability.dashboards``."""

from __future__ import annotations

from cluster.observability.dashboards.cluster import CLUSTER
from cluster.observability.dashboards.engine import ENGINE
from cluster.observability.dashboards.model import Dashboard

DASHBOARDS: tuple[Dashboard, ...] = (ENGINE, CLUSTER)

__all__ = ["CLUSTER", "DASHBOARDS", "ENGINE", "Dashboard"]
