"""Where a new request should go: the replica expected to serve it soonest (pure).

A replica's load is what the controller knows of it (``routing_view``, from the telemetry each
replica sends every control period) or, when the controller is unreachable, the coarser routing
stats Serve polls from each replica: ``running``, ``waiting``, ``max_num_seqs``, ``step_s`` (recent
engine step time) and, from the controller only, ``remaining``: the decode tokens each running
sequence may still generate (max_tokens minus generated, capped like π's R_s).

A new request there has ``ahead`` = max(ongoing, running + waiting) + reserved sequences before it:
``ongoing`` is what this router has sent there and not yet seen finish (exact and immediate, the
report lags a control period), ``reserved`` what it has just chosen it for and not yet sent (a
burst is routed concurrently: without them every request of the burst sees the same empty
replica). Replicas are ranked by

1. the expected wait for a slot, in seconds: 0 while a slot is free (ahead < max_num_seqs: it is
   admitted at the next step); otherwise it waits for the k-th slot to free, k = ahead −
   max_num_seqs + 1. With the remaining work of the running sequences known that is step_s times
   the k-th smallest remaining count (beyond one wave, each further place costs the mean remaining
   over the slots); without it, ahead / max_num_seqs steps, a load proxy;
2. then the load fraction ahead / max_num_seqs: among replicas with free slots the emptier batch
   decodes faster. Not step_s times it: step_s is the recent step time, which on identical
   replicas says how full the batch just was, not how fast the replica is, and would send a
   whole burst to the replica whose last steps happened to be cheapest;
3. then step_s, the faster replica.

Replicas with no load known rank last, in the order given (the caller shuffles).
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence


def _slot_wait_steps(place: int, capacity: int, remaining: Sequence[float]) -> float:
    """Steps until the ``place``-th slot (1-based) of a full replica frees."""
    if not remaining:
        return (capacity + place - 1) / capacity
    ordered = sorted(remaining)
    if place <= len(ordered):
        return float(ordered[place - 1])
    mean = sum(ordered) / len(ordered)
    return ordered[-1] + mean * (place - len(ordered)) / capacity


def ahead_of(stats: dict[str, Any], ongoing: int = 0, reserved: int = 0) -> int:
    return max(ongoing, int(stats.get("running", 0)) + int(stats.get("waiting", 0))) + reserved


def expected_wait_s(stats: dict[str, Any], ahead: int) -> float:
    """Seconds until a slot frees for a request with ``ahead`` sequences before it."""
    capacity = max(1, int(stats.get("max_num_seqs", 1)))
    if ahead < capacity:
        return 0.0
    step = max(float(stats.get("step_s", 0.0)), 1e-3)
    return step * _slot_wait_steps(ahead - capacity + 1, capacity, stats.get("remaining") or ())


def routing_key(stats: dict[str, Any], ongoing: int = 0, reserved: int = 0) -> tuple[float, float, float]:
    ahead = ahead_of(stats, ongoing, reserved)
    capacity = max(1, int(stats.get("max_num_seqs", 1)))
    return expected_wait_s(stats, ahead), ahead / capacity, float(stats.get("step_s", 0.0))


def rank(candidates: Sequence[tuple[Hashable, dict[str, Any] | None, int, int]]) -> list[Hashable]:
    """Candidate ids, soonest first: (id, load or None, ongoing, reserved) each."""
    known = [(routing_key(s, n, r), i, c) for i, (c, s, n, r) in enumerate(candidates) if s]
    unknown = [c for c, s, _, _ in candidates if not s]
    return [c for _, _, c in sorted(known, key=lambda x: (x[0], x[1]))] + unknown
