"""Merging metric families from several replicas into one exposition."""
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from controller.metrics_merge import merge_families, render


def _replica_families(requests: int):
    registry = CollectorRegistry()
    Counter("entropic_tokens", "tokens", ["model_name"], registry=registry).labels("m").inc(requests)
    Histogram("entropic_token_entropy_nats", "H", ["model_name"], buckets=(1, 2), registry=registry).labels("m").observe(1.5)
    return list(registry.collect())


def test_each_replica_keeps_its_series():
    text = render(merge_families({"a": _replica_families(3), "b": _replica_families(5)})).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = {s.labels["replica"]: s.value for s in families["entropic_tokens"].samples if s.name.endswith("_total")}
    assert tokens == {"a": 3.0, "b": 5.0}
    counts = [s for s in families["entropic_token_entropy_nats"].samples if s.name.endswith("_count")]
    assert sorted(s.labels["replica"] for s in counts) == ["a", "b"]
    assert text.count("# TYPE entropic_tokens_total counter") == 1
