"""Merge metric families from several processes into one exposition, one label per source.

Pure prometheus_client data handling (no Ray): each replica's families get a ``replica``
label so identical series from different replicas stay distinct.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric


def merge_families(per_source: Mapping[str, Iterable[Metric]], label: str = "replica") -> list[Metric]:
    merged: dict[str, Metric] = {}
    for source, families in sorted(per_source.items()):
        for family in families:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            elif target.type != family.type:
                continue  # a conflicting definition: keep the first, never emit an invalid exposition
            for sample in family.samples:
                target.add_sample(
                    sample.name, {**sample.labels, label: source}, sample.value, sample.timestamp, sample.exemplar
                )
    return list(merged.values())


class _StaticCollector:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def render(families: list[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StaticCollector(families))
    return generate_latest(registry)
