"""Ray Serve request router for the worker deployment (Serve's alpha RequestRouter API, ray 2.60).

Ranks replicas by ``controller.laws.routing.expected_delay`` from the routing stats each replica
reports (``EntropicWorker.record_routing_stats``, polled by Serve every
``request_routing_stats_period_s``) and the requests this router has in flight on each replica
(``on_send_request`` / ``decrement_queue_len_cache``, which Serve calls for every request).
Serve keeps managing the replicas (health, queue limits, retries): we only order them.
"""
from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from controller.laws.routing import rank


STALE_AFTER_S = 2.0


def _fresh(stats: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    """Stats as of now: a replica's load report older than STALE_AFTER_S is dropped (its capacity and
    step time are kept). Serve pushes routing stats with replica-set updates, which can lag far
    behind the poll period; a stale "busy" would otherwise send every request elsewhere."""
    if not stats:
        return None
    if now - stats.get("at", 0.0) > STALE_AFTER_S:
        return {**stats, "running": 0, "waiting": 0}
    return stats


class SoonestServedRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._ongoing: dict[ReplicaID, int] = defaultdict(int)

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        # Shuffled so that equal expected delays split evenly instead of favouring the first replica.
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        now = time.time()
        ranked = rank([(r, _fresh(r.routing_stats, now), self._ongoing[r.replica_id]) for r in shuffled])
        return [[replica] for replica in ranked]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        # Serve calls this for every request it sends (on_request_routed only in strict-rejection mode).
        super().on_send_request(replica_id)
        self._ongoing[replica_id] += 1

    def decrement_queue_len_cache(self, replica_id: ReplicaID) -> None:
        # Serve calls this when a request finishes on a replica, whatever the outcome.
        super().decrement_queue_len_cache(replica_id)
        self._ongoing[replica_id] = max(0, self._ongoing[replica_id] - 1)
