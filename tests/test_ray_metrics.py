"""deployments.ray_metrics: the names a series takes through Ray. What the mirror sends through Ray's
metrics agent is checked against a real agent and Prometheus in tests/test_prometheus_dashboards.py."""
from __future__ import annotations

from deployments.ray_metrics import ray_metric_name


def test_names_are_sanitized_as_vllm_sanitizes_them_for_ray():
    assert ray_metric_name("vllm:time_to_first_token_seconds") == "vllm_time_to_first_token_seconds"
    assert ray_metric_name("entropic_token_entropy_nats") == "entropic_token_entropy_nats"
