"""The central entropy controller: a plain class (no Ray), run by ``deployments.controller`` as a
single-replica Serve deployment and usable in-process by benchmarks and tests.

Replicas send a ``TelemetryReport`` every control period: the entropy profile of each active
request, their load, and once a second their metric families. The answer carries the scheduling
decisions for that replica's sequences: π(s) and, with ``scheduling.grant_slots`` set, the
decode-step leases to renew. The ingress reads the merged metrics (/metrics), the profiles
(/debug/requests) and the routing view (for its request router) from here. With ``dispatch.enabled``
new requests also wait here for a replica (``controller.dispatcher``): ``enqueue`` / ``withdraw``. With
``migration.enabled`` the answer also moves the replica's unstarted requests that have waited too long to a
replica that can start them sooner (``controller.migrator``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from controller.config import DispatchConfig, MigrationConfig, SchedulingConfig
from controller.dispatcher import Dispatcher
from controller.laws.grants import to_renew
from controller.laws.priority import priorities
from controller.messages import Admission, ControllerAnswer, RoutingView, TelemetryReport, as_json
from controller.metrics_merge import merge_families
from controller.migrator import Migrator
from controller.predictor import RemainingWorkPredictor

_STALE_AFTER_S = 30.0


@dataclass
class _Heard:
    report: TelemetryReport
    answer: ControllerAnswer
    received: float  # controller wall clock
    lag_s: float


class EntropyController:
    def __init__(self, scheduling: SchedulingConfig | None = None, dispatch: DispatchConfig | None = None,
                 migration: MigrationConfig | None = None) -> None:
        self._scheduling = scheduling or SchedulingConfig()
        self._weights = self._scheduling.weights()
        self._grant_policy = self._scheduling.grant_policy() if self._scheduling.grant_slots else None
        self._heard: dict[str, _Heard] = {}
        self._metrics: dict[str, list] = {}
        self._registry = CollectorRegistry(auto_describe=False)
        self._lag = Histogram("entropic_telemetry_lag_seconds",
                              "Delay from a replica sending telemetry to the controller receiving it",
                              buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3), registry=self._registry)
        self._loop = Histogram("entropic_controller_loop_seconds", "Controller time to process one report and compute π",
                               buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1), registry=self._registry)
        self._report_count = Counter("entropic_telemetry_reports", "Telemetry reports received from replicas",
                                     registry=self._registry)
        self._predictor = (RemainingWorkPredictor(self._registry, entropy=self._scheduling.entropy_terms,
                                                  cap_tokens=self._scheduling.remaining_cap_tokens)
                           if self._scheduling.predict_remaining else None)
        self._migrator = (Migrator(migration, self._registry)
                          if migration is not None and migration.enabled else None)
        self._dispatcher = (Dispatcher(dispatch, self._scheduling, self._registry,
                                       remaining=self._predictor.queued if self._predictor is not None else None,
                                       also_in_flight=self._migrator.in_flight if self._migrator is not None else None)
                            if dispatch is not None and dispatch.enabled else None)

    def report(self, report: TelemetryReport) -> ControllerAnswer:
        """Take one replica's telemetry; answer with π for each of its sequences and, with decode-step
        grants on, which of them get their lease renewed this period."""
        started = time.perf_counter()
        now = time.time()
        if report.metrics is not None:
            self._metrics[report.replica_id] = report.metrics
            report = dataclasses.replace(report, metrics=None)
        lag = max(0.0, now - report.sent_at)
        self._lag.observe(lag)
        self._report_count.inc()
        predicted: dict[str, float] = {}
        if self._predictor is not None:
            self._predictor.observe(report)
            if self._predictor.chosen != "budget":
                predicted = {k: self._predictor.remaining(self._predictor.snapshot(s)) for k, s in report.summaries.items()}
                cap = self._scheduling.remaining_cap_tokens
                report = dataclasses.replace(report, load=dataclasses.replace(report.load, remaining=tuple(
                    min(predicted[k], cap) for k, s in report.summaries.items() if s.generated)))
        states = {k: dataclasses.replace(s, waited_s=s.waited_s + lag,
                                         remaining_tokens=predicted.get(k, s.remaining_tokens))
                  for k, s in report.sequences.items()}
        pi = priorities(states, self._weights)
        granted = tuple(to_renew(pi, self._grant_policy)) if self._grant_policy is not None else None
        moves = self._moves(report, pi, now, lag) if self._migrator is not None else None
        answer = ControllerAnswer(priorities=pi, granted=granted, moves=moves)
        self._heard[report.replica_id] = _Heard(report, answer, now, lag)
        if self._dispatcher is not None:
            self._dispatcher.observe(report)
        self._loop.observe(time.perf_counter() - started)
        return answer

    def _moves(self, report: TelemetryReport, pi: dict[str, float], now: float, lag: float) -> dict[str, str] | None:
        assert self._migrator is not None
        heard = {r: (h.report, now - h.received) for r, h in self._heard.items()}
        heard[report.replica_id] = (report, 0.0)
        in_flight = self._migrator.in_flight()
        if self._dispatcher is not None:
            in_flight.update(self._dispatcher.in_flight())
        return self._migrator.decide(report, pi, heard, in_flight, lag) or None

    def enqueue(self, admission: Admission) -> asyncio.Future:
        """Queue a new request for a replica (dispatch on); the future resolves to its ``Grant``."""
        if self._dispatcher is None:
            raise RuntimeError("dispatch is off in this deployment")
        return self._dispatcher.enqueue(admission)

    def withdraw(self, key: str, future: asyncio.Future) -> None:
        if self._dispatcher is not None:
            self._dispatcher.withdraw(key, future)

    def dispatch_view(self) -> dict[str, Any]:
        view: dict[str, Any] = self._dispatcher.snapshot() if self._dispatcher is not None else {"enabled": False}
        if self._predictor is not None:
            view["remaining_work"] = self._predictor.stats()
        return view

    def _live(self) -> dict[str, _Heard]:
        cutoff = time.time() - _STALE_AFTER_S
        return {r: h for r, h in self._heard.items() if h.received >= cutoff}

    def routing_view(self) -> RoutingView:
        """Each live replica's load (deployments.routing) and the age of the report it comes from."""
        now = time.time()
        live = self._live()
        return RoutingView(loads={r: h.report.load for r, h in live.items()},
                           ages_s={r: now - h.received for r, h in live.items()})

    def metric_families(self) -> list:
        """Every live replica's families plus the controller's own (labelled replica="controller")."""
        live = {r: self._metrics[r] for r in self._live() if r in self._metrics}
        return merge_families({**live, "controller": self.own_metric_families()})

    def own_metric_families(self) -> list:
        return list(self._registry.collect())

    def profiles(self) -> dict[str, Any]:
        """Per replica, as JSON: its latest report with π, the grants and the cluster-wide rank of each sequence."""
        live = self._live()
        ranked = sorted(((pi, r, k) for r, h in live.items() for k, pi in h.answer.priorities.items()), reverse=True)
        ranks = {(r, k): i + 1 for i, (_, r, k) in enumerate(ranked)}
        return {r: {**as_json(h.report), "lag_s": h.lag_s, "priorities": h.answer.priorities,
                    "granted": as_json(h.answer.granted),
                    "ranks": {k: ranks[(r, k)] for k in h.answer.priorities}}
                for r, h in live.items()}
