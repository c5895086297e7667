"""Moving waiting work between replicas: the controller's side of migration (the decision itself is
``laws.migration``).

Each report lists the replica's unstarted requests (waiting in its engine's queue, nothing computed) and
how long each has waited there. Against the latest reports of the other replicas, the law picks which to
move where; the answer to that report carries the moves, and the replica hands each one back, still
unstarted, to the ingress, which sends it to the new replica under the same key. Between the decision
and the new replica's report that shows it, a moved request counts against that replica's free slots
(``in_flight``), as a dispatch grant does. How often each request has moved is remembered here, so the law
can bound it; a controller restart forgets it (the replicas' reports rebuild the rest).
"""
from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from controller.config import MigrationConfig
from controller.laws.dispatch import ReplicaSlots
from controller.laws.migration import Stranded, migrations
from controller.messages import TelemetryReport

_FRESH_S = 3.0  # a replica not heard from for this long is no target
_REMEMBERED = 10_000  # requests whose move count is kept (oldest forgotten first)


class Migrator:
    def __init__(self, config: MigrationConfig, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._policy = config.policy()
        self._clock = clock
        self._moving: dict[str, tuple[str, float]] = {}  # key -> (new replica, when), until that replica shows it
        self._moved: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> times moved
        self._decided = Counter("entropic_migrations", "Unstarted requests the controller moved to another replica "
                                "(the replica hands one back only if it is still unstarted when the answer arrives)",
                                registry=registry)
        self._waited = Histogram("entropic_migration_waited_seconds", "How long a moved request had waited on the "
                                 "replica it left", buckets=(0.5, 1, 2, 5, 10, 30, 60), registry=registry)

    def in_flight(self) -> collections.Counter[str]:
        """Moved requests per replica not yet seen in its reports (they hold a slot there)."""
        horizon = self._clock() - self._config.in_flight_s
        for key, (_, at) in list(self._moving.items()):
            if at < horizon:
                del self._moving[key]
        return collections.Counter(rid for rid, _ in self._moving.values())

    def decide(self, report: TelemetryReport, pi: Mapping[str, float], heard: Mapping[str, tuple[TelemetryReport, float]],
               in_flight: Mapping[str, int], lag_s: float) -> dict[str, str]:
        """The moves for the reporting replica's unstarted requests. ``heard``: every replica's latest report
        and its age in seconds, the reporting one's included; ``in_flight``: requests dispatched or moved to
        each replica and not yet in its reports."""
        for key in report.sequences.keys() & self._moving.keys():
            if self._moving[key][0] == report.replica_id:
                del self._moving[key]
        if not report.unstarted:
            return {}
        now = self._clock()
        slots = {rid: ReplicaSlots(load=r.load, in_flight=in_flight.get(rid, 0), kv_free_tokens=r.kv_free_tokens,
                                   kv_total_tokens=r.kv_total_tokens)
                 for rid, (r, age) in heard.items() if age <= _FRESH_S}
        stranded = [Stranded(key=key, replica_id=report.replica_id, waited_s=waited + lag_s, pi=pi.get(key, 0.0),
                             kv_tokens=report.summaries[key].prompt_tokens if key in report.summaries else 0,
                             moves=self._moved.get(key, 0))
                    for key, waited in report.unstarted.items()]
        moves = dict(migrations(stranded, slots, self._policy))
        waited = {s.key: s.waited_s for s in stranded}
        for key, target in moves.items():
            self._moving[key] = (target, now)
            self._moved[key] = self._moved.get(key, 0) + 1
            self._moved.move_to_end(key)
            self._decided.inc()
            self._waited.observe(waited[key])
        while len(self._moved) > _REMEMBERED:
            self._moved.popitem(last=False)
        return moves
