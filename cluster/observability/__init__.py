"""Metrics: the metrics actor (``metrics_actor``) over a plain registry
(``metrics_registry``), Grafana dashboards generated from code (``dashboards``) and a
local Prometheus sidecar (``prometheus_local``)."""
