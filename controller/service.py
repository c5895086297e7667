"""The central entropy controller as a single-replica Serve deployment.

Replicas stream telemetry here at the control period (``report``): the entropy profile of
each active request and, once a second, their metric families. The ingress reads the
merged metrics from here for /metrics and the profiles for /debug/requests, and the routing view
for its request router. The answer to a report carries the scheduling decisions for that replica's
sequences: π(s) and, with ``scheduling.grant_slots`` set, the decode-step leases to renew.
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from ray import serve

from controller.laws.grants import to_renew
from controller.laws.priority import SequenceState, priorities
from controller.metrics_merge import merge_families

_STALE_AFTER_S = 30.0
_ROUTING_FIELDS = ("running", "waiting", "max_num_seqs", "step_s", "unit_step_s", "remaining")


@serve.deployment(name="EntropyController", num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0})
class EntropyController:
    def __init__(self, config: dict[str, Any] | None = None) -> None:
        from deployments.config import AppConfig

        self._scheduling = AppConfig.model_validate(config or {}).scheduling
        self._weights = self._scheduling.weights()
        self._grant_policy = self._scheduling.grant_policy() if self._scheduling.grant_slots else None
        self._reports: dict[str, dict[str, Any]] = {}
        self._received: dict[str, float] = {}
        self._metrics: dict[str, list] = {}
        self._registry = CollectorRegistry(auto_describe=False)
        self._lag = Histogram("entropic_telemetry_lag_seconds", "Delay from a replica sending telemetry to the controller receiving it",
                              buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3), registry=self._registry)
        self._loop = Histogram("entropic_controller_loop_seconds", "Controller time to process one report and compute π",
                               buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1), registry=self._registry)
        self._report_count = Counter("entropic_telemetry_reports", "Telemetry reports received from replicas",
                                     registry=self._registry)

    def report(self, replica_id: str, report: dict[str, Any]) -> dict[str, Any]:
        """Take one replica's telemetry; answer with π for each of its sequences and, with decode-step
        grants on, which of them get their lease renewed this period."""
        started = time.perf_counter()
        now = time.time()
        self._received[replica_id] = now
        metrics = report.pop("metrics", None)
        if metrics is not None:
            self._metrics[replica_id] = metrics
        report["lag_s"] = max(0.0, now - report.get("sent_at", now))
        self._lag.observe(report["lag_s"])
        self._report_count.inc()
        states = {k: SequenceState(**{**s, "waited_s": s["waited_s"] + report["lag_s"]})
                  for k, s in report.get("sequences", {}).items()}
        report["priorities"] = priorities(states, self._weights)
        answer = {"priorities": report["priorities"]}
        if self._grant_policy is not None:
            answer["granted"] = report["granted"] = to_renew(report["priorities"], self._grant_policy)
        self._reports[replica_id] = report
        self._loop.observe(time.perf_counter() - started)
        return answer

    def _live(self) -> list[str]:
        cutoff = time.time() - _STALE_AFTER_S
        return [r for r, t in self._received.items() if t >= cutoff]

    def routing_view(self) -> dict[str, Any]:
        """What routing needs of each live replica (its load and the remaining work of its running
        sequences, deployments.routing), with the age of the report it comes from."""
        now = time.time()
        return {"replicas": {r: {**{f: self._reports[r].get(f) for f in _ROUTING_FIELDS}, "age_s": now - self._received[r]}
                             for r in self._live() if r in self._reports}}

    def metric_families(self) -> list:
        """Every live replica's families plus the controller's own (labelled replica="controller")."""
        live = {r: self._metrics[r] for r in self._live() if r in self._metrics}
        return merge_families({**live, "controller": list(self._registry.collect())})

    def profiles(self) -> dict[str, Any]:
        """Per replica: its latest report, with π and the cluster-wide rank of each sequence."""
        live = {r: self._reports[r] for r in self._live()}
        ranked = sorted(((pi, r, k) for r, rep in live.items() for k, pi in rep.get("priorities", {}).items()),
                        reverse=True)
        ranks = {(r, k): i + 1 for i, (_, r, k) in enumerate(ranked)}
        return {r: {**rep, "ranks": {k: ranks[(r, k)] for k in rep.get("priorities", {})}} for r, rep in live.items()}
