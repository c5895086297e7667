"""The controller's cluster-wide queue: new requests wait here, highest π first, until a replica has a
free batch slot and KV cache for them (late binding; the decision itself is ``laws.dispatch``).

The ingress enqueues an ``Admission`` and awaits its ``Grant``. The queue is decided again whenever
something can change the answer: a request joins, a replica reports (a slot or KV cache freed), a
request's deadline comes; events of one event-loop turn share one decision, since deciding costs in
proportion to the queue and reports arrive from every replica every control period. Between a grant
and the replica's next report that shows the request, the request counts against that replica's free
slots (``in_flight``), so a burst is not all sent to the replica that looked emptiest. A report also
tells where each granted request landed: on the granted replica or, when Serve's router had to send
it elsewhere (the replica refused it, or died), elsewhere.

The queue lives only here. After a controller restart it is rebuilt by the ingress, which resends what
it was still waiting for with the time already waited (so aging keeps its order), and the replicas'
reports rebuild the slot accounting. Asyncio, one event loop, no Ray.
"""
from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.config import DispatchConfig, SchedulingConfig
from controller.laws.dispatch import QueuedRequest, ReplicaSlots, dispatch
from controller.laws.priority import SequenceState, priority
from controller.messages import Admission, Grant, TelemetryReport

# π's memory term counts blocks; a queued request has none yet, so its prompt is priced in blocks of this
# size. Only the order among queued requests uses it, and they all use the same unit.
_QUEUE_BLOCK_TOKENS = 64
# Decisions that granted something, kept for /debug/dispatch: enough to see one burst whole.
_RECENT_DECISIONS = 32


@dataclass(slots=True)
class _Waiting:
    admission: Admission
    arrived: float  # this controller's clock, minus what it had waited before
    future: asyncio.Future
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _Replica:
    report: TelemetryReport
    heard: float


class Dispatcher:
    def __init__(self, config: DispatchConfig, scheduling: SchedulingConfig, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic,
                 remaining: Callable[[int, int | None], float] | None = None,
                 also_in_flight: Callable[[], Mapping[str, int]] | None = None) -> None:
        """``also_in_flight``: requests sent to each replica by other means (migration) not yet in its reports."""
        self._config = config
        self._also_in_flight = also_in_flight
        self._remaining = remaining  # (prompt tokens, max_tokens) -> predicted output tokens; None: the budget
        self._weights = scheduling.weights()
        self._slo_s = scheduling.slo_s
        self._prior_drop = scheduling.prior_drop
        self._max_wait_s = config.max_wait_s or scheduling.slo_s
        self._clock = clock
        self._queue: dict[str, _Waiting] = {}
        self._replicas: dict[str, _Replica] = {}
        self._granted: dict[str, tuple[str, float]] = {}  # key -> (replica, granted at), until seen in a report
        self._decision_pending = False
        # What each recent granting decision saw and chose (when, grants, the law's frozen inputs): loads move
        # with every report, so why a burst split as it did can only be read from the decisions themselves.
        self._recent: collections.deque[tuple[float, tuple[tuple[str, str], ...], dict[str, ReplicaSlots]]] = \
            collections.deque(maxlen=_RECENT_DECISIONS)
        self._queued = Gauge("entropic_dispatch_queue_length", "Requests waiting in the controller's queue",
                             registry=registry)
        self._oldest = Gauge("entropic_dispatch_queue_oldest_seconds", "How long the oldest queued request has "
                             "waited", registry=registry)
        self._wait = Histogram("entropic_dispatch_wait_seconds", "Time from joining the controller's queue to a "
                               "grant", buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                               registry=registry)
        self._shed = Counter("entropic_dispatch_shed", "Requests the queue did not dispatch, by reason",
                             ["reason"], registry=registry)
        self._landed = Counter("entropic_dispatch_landed", "Granted requests by where the replicas' reports "
                               "showed them (granted: the replica the grant named; elsewhere: another; unseen: "
                               "none within in_flight_s, e.g. it finished between two reports)",
                               ["where"], registry=registry)
        for reason in ("queue_full", "deadline", "too_large"):  # every series from the start, at 0
            self._shed.labels(reason=reason)
        for where in ("granted", "elsewhere", "unseen"):
            self._landed.labels(where=where)
        self._decisions = Histogram("entropic_dispatch_decision_seconds", "Time to decide the whole queue once",
                                    buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03), registry=registry)

    # --- the ingress's side ----------------------------------------------------------------------
    def enqueue(self, admission: Admission) -> asyncio.Future:
        """Queue a request; the future resolves to its Grant (a replica, or why none)."""
        earlier = self._queue.pop(admission.key, None)
        if earlier is not None:  # resent (the ingress stopped waiting on the first): the new one replaces it
            self._close(earlier, None)
        future = asyncio.get_running_loop().create_future()
        if len(self._queue) >= self._config.max_queued:
            self._shed.labels(reason="queue_full").inc()
            future.set_result(Grant(key=admission.key, replica_id=None, shed="queue_full", waited_s=admission.waited_s))
            return future
        now = self._clock()
        entry = _Waiting(admission, now - admission.waited_s, future)
        left = min(admission.max_wait_s, self._max_wait_s) - admission.waited_s
        # The law sheds at its next decision past the deadline; this makes sure there is one.
        entry.timer = asyncio.get_running_loop().call_later(max(0.0, left) + 1e-3, self._decide_soon)
        self._queue[admission.key] = entry
        self._decide_soon()
        return future

    def withdraw(self, key: str, future: asyncio.Future) -> None:
        """The ingress stopped waiting on ``future`` (its client left, or it timed out): forget the request."""
        entry = self._queue.get(key)
        if entry is not None and entry.future is future:
            del self._queue[key]
            self._close(entry, None)

    def in_flight(self) -> collections.Counter[str]:
        """Granted requests per replica not yet seen in its reports."""
        return collections.Counter(rid for rid, _ in self._granted.values())

    # --- the replicas' side ----------------------------------------------------------------------
    def observe(self, report: TelemetryReport) -> None:
        now = self._clock()
        replica = self._replicas.get(report.replica_id)
        if replica is None:
            replica = self._replicas[report.replica_id] = _Replica(report, now)
        replica.report, replica.heard = report, now
        for key in report.sequences.keys() & self._granted.keys():
            granted_to, _ = self._granted.pop(key)
            self._landed.labels(where="granted" if granted_to == report.replica_id else "elsewhere").inc()
        if self._queue:
            self._decide_soon()

    # --- deciding --------------------------------------------------------------------------------
    def _decide_soon(self) -> None:
        if self._decision_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside a loop (an in-process caller): nothing to coalesce with
            self.decide()
            return
        self._decision_pending = True
        loop.call_soon(self.decide)

    def decide(self) -> None:
        self._decision_pending = False
        started = time.perf_counter()
        now = self._clock()
        self._expire(now)
        live = {rid: r for rid, r in self._replicas.items() if now - r.heard <= self._config.stale_after_s}
        in_flight = self.in_flight()
        if self._also_in_flight is not None:
            in_flight.update(self._also_in_flight())
        slots = {rid: ReplicaSlots(load=r.report.load, in_flight=in_flight[rid],
                                   kv_free_tokens=r.report.kv_free_tokens, kv_total_tokens=r.report.kv_total_tokens)
                 for rid, r in live.items()}
        queue = [self._queued_request(entry, now) for entry in self._queue.values()]
        decision = dispatch(queue, slots, now)
        if decision.assigned:  # rendered as JSON only when /debug/dispatch asks
            self._recent.append((now, decision.assigned, slots))
        for key, rid in decision.assigned:
            entry = self._queue.pop(key)
            self._granted[key] = (rid, now)
            self._wait.observe(now - entry.arrived)
            self._close(entry, Grant(key=key, replica_id=rid, waited_s=now - entry.arrived))
        for key, reason in decision.shed:
            entry = self._queue.pop(key)
            self._shed.labels(reason=reason).inc()
            self._close(entry, Grant(key=key, replica_id=None, shed=reason, waited_s=now - entry.arrived))
        self._queued.set(len(self._queue))
        self._oldest.set(max((now - e.arrived for e in self._queue.values()), default=0.0))
        self._decisions.observe(time.perf_counter() - started)

    def _queued_request(self, entry: _Waiting, now: float) -> QueuedRequest:
        a = entry.admission
        waited = now - entry.arrived
        if self._remaining is not None:
            remaining = self._remaining(a.prompt_tokens, a.max_tokens)
        else:
            remaining = a.max_tokens if a.max_tokens is not None else self._weights.remaining_cap_tokens
        state = SequenceState(expected_drop=self._prior_drop, attended_tokens=a.prompt_tokens * a.compute_factor,
                              kv_blocks=a.prompt_tokens / _QUEUE_BLOCK_TOKENS, waited_s=waited, slo_s=self._slo_s,
                              remaining_tokens=float(remaining))
        return QueuedRequest(key=a.key, pi=priority(state, self._weights), arrived_s=entry.arrived,
                             deadline_s=entry.arrived + min(a.max_wait_s, self._max_wait_s), kv_tokens=a.prompt_tokens)

    def _expire(self, now: float) -> None:
        """Grants the replicas' reports never showed stop counting against their slots after in_flight_s."""
        horizon = now - self._config.in_flight_s
        for key, (_, at) in list(self._granted.items()):
            if at < horizon:
                del self._granted[key]
                self._landed.labels(where="unseen").inc()
        for rid, replica in list(self._replicas.items()):
            if now - replica.heard > 10 * self._config.stale_after_s:
                del self._replicas[rid]  # gone for good (replaced): its state would only grow

    @staticmethod
    def _close(entry: _Waiting, grant: Grant | None) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        if entry.future.done():
            return
        if grant is None:
            entry.future.cancel()
        else:
            entry.future.set_result(grant)

    def snapshot(self) -> dict[str, Any]:
        """The queue and the slot accounting as JSON (/debug/dispatch)."""
        now = self._clock()
        granted: dict[str, list[str]] = collections.defaultdict(list)
        for key, (rid, _) in self._granted.items():
            granted[rid].append(key)
        return {"queue": [{"key": e.admission.key, "waited_s": now - e.arrived,
                           "prompt_tokens": e.admission.prompt_tokens} for e in self._queue.values()],
                "replicas": {rid: {"heard_s_ago": now - r.heard, "in_flight": sorted(granted[rid]),
                                   "running": r.report.load.running, "waiting": r.report.load.waiting,
                                   "kv_free_tokens": r.report.kv_free_tokens} for rid, r in self._replicas.items()},
                "decisions": [{"at_s": at, "at_s_ago": now - at, "assigned": [list(a) for a in assigned],
                               "replicas": {rid: _slots_json(s) for rid, s in seen.items()}}
                              for at, assigned, seen in self._recent]}


def _slots_json(slots: ReplicaSlots) -> dict[str, Any]:
    load = slots.load
    return {"running": load.running, "waiting": load.waiting, "max_num_seqs": load.max_num_seqs,
            "step_s": load.step_s, "unit_step_s": load.unit_step_s, "remaining": list(load.remaining),
            "in_flight": slots.in_flight, "kv_free_tokens": slots.kv_free_tokens,
            "kv_total_tokens": slots.kv_total_tokens}
