"""The ingresses' stream-resume counters in the registry: summed per model, failures by
reason, every known series at 0 until counted."""

from __future__ import annotations

from cluster.observability.metrics_registry import MetricsRegistry, prometheus_registry, render_text


def test_resume_counts_are_summed_per_model_with_zeros_first():
    reg = MetricsRegistry()
    reg.add_ingress_count("m", "hybridserve_stream_migrations_total")
    reg.add_ingress_count("m", "hybridserve_stream_migrations_total")
    reg.add_ingress_count("m", "hybridserve_stream_resume_failures_total", "timeout")
    text = render_text(prometheus_registry(reg))
    assert 'hybridserve_stream_migrations_total{model="m"} 2.0' in text
    assert 'hybridserve_stream_retries_total{model="m"} 0.0' in text
    assert 'hybridserve_stream_resume_failures_total{model="m",reason="timeout"} 1.0' in text
    assert 'hybridserve_stream_resume_failures_total{model="m",reason="refused"} 0.0' in text
