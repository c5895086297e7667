"""Ray Serve request router for the worker deployment (Serve's alpha RequestRouter API, ray 2.60).

Ranks replicas by ``controller.laws.routing.expected_delay`` from the routing stats each replica
reports (``EntropicWorker.record_routing_stats``, polled by Serve every
``request_routing_stats_period_s``), corrected by what this router sent since that report.
Serve keeps managing the replicas (health, queue limits, retries): we only order them.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from controller.laws.routing import rank


class SoonestServedRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._sent_since_report: dict[ReplicaID, int] = defaultdict(int)
        self._report_stamp: dict[ReplicaID, Any] = {}

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        candidates = []
        for replica in candidate_replicas:
            stats = replica.routing_stats or None
            stamp = (stats or {}).get("at")
            if self._report_stamp.get(replica.replica_id) != stamp:
                self._report_stamp[replica.replica_id] = stamp
                self._sent_since_report[replica.replica_id] = 0
            candidates.append((replica, stats, self._sent_since_report[replica.replica_id]))
        return [[replica] for replica in rank(candidates)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._sent_since_report[replica_id] += 1
