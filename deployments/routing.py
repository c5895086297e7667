"""Ray Serve request router for the worker deployment (Serve's alpha RequestRouter API, ray 2.60),
and the controller's routing view it reads.

The ingress polls the controller's ``routing_view`` every control period and publishes it in its
process (``deployments.routing_view``); the routers of the ingress's handles read it. That is the shape of
Ray Serve LLM's own KV-aware router, which reads a tracker its ingress registers in the same process:
a router cannot hold a handle of its own, and Serve's routing stats (``record_routing_stats``) are
pushed with replica-set updates, which lagged seconds behind the poll period in our tests, while the
controller's view is one telemetry period old. When the view is stale (controller down or late) a
replica is ranked from Serve's stats, and with neither it ranks last.

Replicas are ranked by ``controller.laws.routing.expected_delay``. Serve keeps managing them (health,
queue limits, retries): we only order them.

With the controller's dispatch on, a request arrives here with its ``Grant`` (the fourth argument of
``EntropicWorker.generate``): the granted replica goes first, the usual ranking after it, for when
that replica refuses or has gone. ``GrantedPowerOfTwoRouter`` does the same in front of Serve's own
power-of-two choice.
"""
from __future__ import annotations

import random
import time
from collections import defaultdict, deque
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from controller.laws.routing import ReplicaLoad, rank
from deployments import routing_view
from deployments.routing_view import STALE_AFTER_S

RESERVE_S = 1.0  # a choice not followed by a send within this is forgotten (Serve tried another replica)


def _fresh(stats: dict[str, Any] | None, now: float) -> ReplicaLoad | None:
    """Serve's polled stats (deployments.worker.record_routing_stats) as of now: a load older than
    STALE_AFTER_S is dropped (capacity and step time are kept)."""
    if not stats:
        return None
    stale = now - stats["at"] > STALE_AFTER_S
    return ReplicaLoad(running=0 if stale else stats["running"], waiting=0 if stale else stats["waiting"],
                       max_num_seqs=stats["max_num_seqs"], step_s=stats["step_s"], unit_step_s=stats["unit_step_s"])


def replica_load(replica: RunningReplica, view: routing_view.ControllerView,
                 now_wall: float) -> tuple[ReplicaLoad | None, str]:
    load = view.load(replica.replica_id.unique_id)
    if load is not None:
        return load, "controller"
    stats = _fresh(replica.routing_stats, now_wall)
    return stats, ("replica_stats" if stats else "none")


def granted_replica(candidates: list[RunningReplica], pending_request: PendingRequest | None) -> RunningReplica | None:
    """The replica the controller granted this request, when it is still a candidate."""
    args: list[Any] = pending_request.args if pending_request is not None else []
    replica_id = getattr(args[3], "replica_id", None) if len(args) > 3 else None
    if replica_id is None:
        return None
    return next((r for r in candidates if r.replica_id.unique_id == replica_id), None)


class GrantedPowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's power-of-two router behind the controller's grant."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        chosen = granted_replica(candidate_replicas, pending_request)
        if chosen is None:
            return ranks
        routing_view.record_decision("grant")
        return [[chosen], *ranks]


class SoonestServedRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._ongoing: dict[ReplicaID, int] = defaultdict(int)
        self._reserved: dict[ReplicaID, deque[float]] = defaultdict(deque)

    def _reservations(self, replica_id: ReplicaID, now: float) -> int:
        pending = self._reserved[replica_id]
        while pending and pending[0] < now:
            pending.popleft()
        return len(pending)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        # Shuffled so that equal expected delays split evenly instead of favouring the first replica.
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        now, wall = time.monotonic(), time.time()
        # Through the module, not a name bound here: Serve pickles this module by value into each
        # handle's process, so a global of ours would be a copy the ingress never updates.
        loads = {r.replica_id: replica_load(r, routing_view.CONTROLLER_VIEW, wall) for r in shuffled}
        ranked = rank([(r, loads[r.replica_id][0], self._ongoing[r.replica_id],
                        self._reservations(r.replica_id, now)) for r in shuffled])
        chosen = granted_replica(candidate_replicas, pending_request)
        if chosen is not None:  # the controller's dispatch counted it already: no reservation
            routing_view.record_decision("grant")
            return [[chosen], *([r] for r in ranked if r is not chosen)]
        if ranked:
            self._reserved[ranked[0].replica_id].append(now + RESERVE_S)
            routing_view.record_decision(loads[ranked[0].replica_id][1])
        return [[replica] for replica in ranked]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # Serve calls this for every request it sends (on_request_routed only in strict-rejection mode).
        super().on_send_request(replica_id)
        self._ongoing[replica_id] += 1
        if self._reserved[replica_id]:
            self._reserved[replica_id].popleft()

    def decrement_queue_len_cache(self, replica_id: ReplicaID) -> None:
        # Serve calls this when a request finishes on a replica, whatever the outcome.
        super().decrement_queue_len_cache(replica_id)
        self._ongoing[replica_id] = max(0, self._ongoing[replica_id] - 1)
