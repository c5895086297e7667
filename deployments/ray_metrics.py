"""A process's Prometheus series through Ray's metrics agent: the path on which they add up in a cluster.

Ray runs one metrics agent per node (``metrics-export-port``); it exports what the processes on its node
record with ``ray.util.metrics``, each series labelled with the ``WorkerId`` that recorded it. Scraping
every node's agent (KubeRay's PodMonitor, or the targets Ray lists for Prometheus) therefore counts each
replica's series exactly once, however many nodes, pods and Serve proxies there are. vLLM's own Ray
path (``vllm.v1.metrics.ray_wrappers``) works the same way and names series as this module does:
``vllm:time_to_first_token_seconds`` is exported as ``ray_vllm_time_to_first_token_seconds``
(``monitoring/prometheus-ray.yml`` renames them back, so one dashboard serves both paths).

Our series live in ``prometheus_client`` registries (the engine's child process, the ingress, the
controller), so ``RayMirror`` copies snapshots of them: a counter by its increase since the last
snapshot, a gauge by its value, and a histogram as the series Prometheus reads from one: a counter per
cumulative bucket (``<name>_bucket``, tagged ``le``), a counter of its observations (``<name>_count``) and
a gauge of its sum (``<name>_sum``; a sum may fall), all exact. Ray exports a counter with ``_total``
appended (``ray_vllm_e2e_request_latency_seconds_bucket_total``); the scrape configs take that back off.

Not a Ray ``Histogram``: at every export (about every 10 s) Ray's metrics agent turns each histogram's
bucket counts back into single observations and records them one by one in Python
(``OpenTelemetryMetricRecorder.record_histogram_aggregated_batch``), so its work grows with the
observations made, not with the series, and our per-token histograms (entropy, temperature, kept blocks,
inter-token gaps) make several observations per output token. Under load that work stopped every stream's
tokens on their way out while it lasted (measured in docs/results/README.md, "Ray's metrics agent"). As
counters the agent's work is per series. It also makes ``_sum`` exact, which Ray's histograms rebuild from
bucket midpoints (Ray issue 64852).
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.utils import floatToGoString

logger = logging.getLogger(__name__)

MIRROR_PERIOD_S = 1.0


def ray_metric_name(name: str) -> str:
    """The name Ray's OpenTelemetry exporter accepts (no ':'), as vLLM's Ray stat logger sanitizes it."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


class RayMirror:
    """Copies snapshots of ``prometheus_client`` metric families into ``ray.util.metrics``.

    ``source`` becomes the ``replica`` label of every series (a worker replica's id, ``ingress``,
    ``controller``), as on the merged /metrics page. Call ``update`` with every new snapshot of the same
    registry, which lives as long as this mirror (a replica's engine process does not outlive it)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._metrics: dict[str, Any] = {}
        self._tag_keys: dict[str, tuple[str, ...]] = {}
        self._last: dict[tuple, tuple[float, ...]] = {}  # per counter or histogram series: what was mirrored
        self._skipped: set[str] = set()

    def update(self, families: Iterable[Any]) -> None:
        for family in families:
            if family.type in ("gauge", "info", "unknown"):
                self._guarded(family.name, self._gauge, family)
            elif family.type in ("counter", "histogram"):
                for key, (labels, values, uppers) in _cumulative(family).items():
                    before = self._last.get(key, (0.0,) * len(values))
                    self._guarded(family.name, self._add, family, labels, values, before, uppers)
                    self._last[key] = values

    def _guarded(self, name: str, apply: Callable[..., None], *args: Any) -> None:
        try:
            apply(*args)
        except (TypeError, ValueError) as exc:  # Ray refused it (name, tags, boundaries): say so once
            if name not in self._skipped:
                self._skipped.add(name)
                logger.warning("metric %s is not exported through Ray: %s", name, exc)

    def _declare(self, kind: str, name: str, documentation: str, labels: Iterable[str], **extra: Any) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            from ray.util import metrics

            keys = tuple(sorted(set(labels) - {"replica"})) + ("replica",)
            metric = getattr(metrics, kind)(name, _ascii(documentation), tag_keys=keys, **extra)
            self._metrics[name], self._tag_keys[name] = metric, keys
        return metric

    def _tags(self, name: str, labels: dict[str, str]) -> dict[str, str]:
        keys = self._tag_keys[name]
        if not set(labels) - {"replica"} <= set(keys):
            raise ValueError(f"labels {sorted(labels)} differ from those first seen, {list(keys)}")
        return {k: str(labels.get(k, "")) for k in keys} | {"replica": self.source}

    def _gauge(self, family: Any) -> None:
        for sample in family.samples:
            name = ray_metric_name(sample.name)
            gauge = self._declare("Gauge", name, family.documentation, sample.labels)
            gauge.set(float(sample.value), tags=self._tags(name, sample.labels))

    def _add(self, family: Any, labels: dict[str, str], values: tuple[float, ...], before: tuple[float, ...],
             uppers: list[float]) -> None:
        """``values``: a counter's value, or a histogram's cumulative bucket counts then its sum."""
        name = ray_metric_name(family.name)
        if family.type == "counter":
            counter = self._declare("Counter", name, family.documentation, labels)
            if values[0] > before[0]:
                counter.inc(values[0] - before[0], tags=self._tags(name, labels))
            return
        cumulative, total = values[:-1], values[-1]
        grown = [round(now - then) for now, then in zip(cumulative, before[:-1])]
        if min(grown, default=0) < 0:  # counts never fall in one registry; a snapshot where they did is skipped
            return
        if any(grown):
            buckets = self._declare("Counter", f"{name}_bucket", family.documentation, [*labels, "le"])
            for upper, count in zip(uppers, grown):
                if count:
                    buckets.inc(count, tags=self._tags(f"{name}_bucket", {**labels, "le": floatToGoString(upper)}))
            count = self._declare("Counter", f"{name}_count", family.documentation, labels)
            count.inc(grown[-1], tags=self._tags(f"{name}_count", labels))  # the +Inf bucket: every observation
        # Set on every snapshot once there are observations: Ray's agent drops a gauge not reported for a while.
        # prometheus_client leaves out the sum of a histogram with a negative bucket.
        if cumulative and cumulative[-1] > 0 and not math.isnan(total):
            self._declare("Gauge", f"{name}_sum", family.documentation, labels).set(
                total, tags=self._tags(f"{name}_sum", labels))


def _ascii(text: str) -> str:
    """Ray takes only ASCII descriptions (ours name π and τ)."""
    for letter, name in (("π", "pi"), ("τ", "tau"), ("Ĥ", "H"), ("α", "alpha"), ("δ", "delta")):
        text = text.replace(letter, name)
    return text.encode("ascii", "replace").decode()


def _cumulative(family: Any) -> dict[tuple, tuple[dict[str, str], tuple[float, ...], list[float]]]:
    """Per series of a counter or histogram family: (labels, values, bucket upper bounds), where
    values are a counter's value, or a histogram's cumulative bucket counts followed by its sum."""
    out: dict[tuple, tuple[dict[str, str], tuple[float, ...], list[float]]] = {}
    if family.type == "counter":
        for sample in family.samples:
            if sample.name.endswith("_total"):  # not _created
                out[(family.name, tuple(sorted(sample.labels.items())))] = (sample.labels, (sample.value,), [])
        return out
    grouped: dict[tuple, dict[str, Any]] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        entry = grouped.setdefault(tuple(sorted(labels.items())), {"labels": labels, "buckets": [], "sum": math.nan})
        if sample.name.endswith("_bucket"):
            entry["buckets"].append((float(sample.labels["le"]), sample.value))
        elif sample.name.endswith("_sum"):
            entry["sum"] = sample.value
    for key, entry in grouped.items():
        buckets = sorted(entry["buckets"])
        out[(family.name, key)] = (entry["labels"], (*(c for _, c in buckets), entry["sum"]), [u for u, _ in buckets])
    return out


def mirror_periodically(collect: Callable[[], Iterable[Any]], source: str,
                        period_s: float = MIRROR_PERIOD_S) -> asyncio.Task:
    """On the running event loop: mirror ``collect()`` (a registry's families) every ``period_s``."""
    mirror = RayMirror(source)

    async def loop() -> None:
        while True:
            try:
                mirror.update(collect())
            except Exception:  # metrics must never take a replica down
                logger.exception("mirroring %s's metrics to Ray failed", source)
            await asyncio.sleep(period_s)

    return asyncio.get_event_loop().create_task(loop())
