"""The controller's routing view as seen in the ingress process, and the router's decision counts.

Its own module because Serve pickles the request router's module by value into every process that
holds a handle (ray.serve.config.RequestRouterConfig): state kept there would be a private copy per
router. This module is imported by reference, so the ingress (writer) and the routers of its
handles (readers) share one view.
"""
from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from controller.laws.routing import ReplicaLoad
from controller.messages import RoutingView, as_json

STALE_AFTER_S = 2.0  # a load older than this is not a load: replicas report at least once a second

ROUTING_REGISTRY = CollectorRegistry(auto_describe=False)
_DECISIONS = Counter("entropic_routing_decisions", "Requests routed, by where the chosen replica's load came from "
                    "(controller, replica_stats: Serve's polled stats, none: nothing known; grant: the replica the "
                    "controller's dispatch granted)",
                    ["source"], registry=ROUTING_REGISTRY)
_ADMISSIONS = Counter("entropic_dispatch_admissions", "Requests this ingress asked the controller's queue for a "
                      "replica, by outcome (controller: granted; fallback: the controller was unreachable or late, "
                      "Serve's router chose; queue_full, deadline: shed with 503; too_large: no replica's KV cache "
                      "holds its prompt, the engine judges it)", ["outcome"], registry=ROUTING_REGISTRY)
HTTP_RESPONSES = Counter("entropic_http_responses", "HTTP responses this ingress sent, by status code and route "
                         "(the OpenAI routes by path; everything else as other)", ["code", "route"],
                         registry=ROUTING_REGISTRY)


class ControllerView:
    """The controller's latest per-replica loads, as seen in this process.

    Ages are measured with this process's monotonic clock plus the age the controller reported, so
    clocks of different nodes never need to agree."""

    def __init__(self) -> None:
        self._view = RoutingView(loads={}, ages_s={})
        self._polled = 0.0

    def publish(self, view: RoutingView, now: float | None = None) -> None:
        self._view = view
        self._polled = time.monotonic() if now is None else now

    def load(self, replica: str, now: float | None = None) -> ReplicaLoad | None:
        entry = self._view.loads.get(replica)
        if entry is None:
            return None
        now = time.monotonic() if now is None else now
        return entry if (now - self._polled) + self._view.ages_s[replica] <= STALE_AFTER_S else None

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        return {"polled_s_ago": now - self._polled if self._polled else None,
                "replicas": {r: {**as_json(load), "age_s": self._view.ages_s[r]} for r, load in self._view.loads.items()}}


CONTROLLER_VIEW = ControllerView()


def record_decision(source: str) -> None:
    _DECISIONS.labels(source=source).inc()


for _outcome in ("controller", "fallback", "queue_full", "deadline", "too_large"):  # every series from the start
    _ADMISSIONS.labels(outcome=_outcome)


def record_admission(outcome: str) -> None:
    _ADMISSIONS.labels(outcome=outcome).inc()


def decision_counts() -> dict[str, float]:
    return {s.labels["source"]: s.value for m in ROUTING_REGISTRY.collect() for s in m.samples
            if s.name == "entropic_routing_decisions_total"}


def admission_counts() -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in ROUTING_REGISTRY.collect() for s in m.samples
            if s.name == "entropic_dispatch_admissions_total"}
