"""Where a new request should go: the replica expected to serve it soonest (pure).

A replica's load is what the controller knows of it (``routing_view``, from the telemetry each
replica sends every control period) or, when the controller is unreachable, the coarser routing
stats Serve polls from each replica: ``running``, ``waiting``, ``max_num_seqs``, ``step_s`` (recent
engine step time) and, from the controller only, ``remaining``: the decode tokens each running
sequence may still generate (max_tokens minus generated, capped like π's R_s).

Step time grows with the batch, so a recent step time says as much about how full the batch was
as about how fast the replica is. Replicas therefore also report ``unit_step_s``: their step time
normalized to an empty batch, step_s / g(batch) with g(b) = 1 + b / max_num_seqs (``batch_factor``;
a linear shape assumed for every replica alike, so it cancels between identical replicas and keeps
real speed differences). A replica's step time at batch b is then unit_step_s · g(b).

A new request there has ``ahead`` = max(ongoing, running + waiting) + reserved sequences before it:
``ongoing`` is what this router has sent there and not yet seen finish (exact and immediate, the
report lags a control period), ``reserved`` what it has just chosen it for and not yet sent (a
burst is routed concurrently: without them every request of the burst sees the same empty
replica). Expected delay, in seconds, until it has its first tokens:

* while a slot is free (ahead < max_num_seqs) no wait; otherwise the wait for the k-th slot to
  free, k = ahead − max_num_seqs + 1: with the remaining work of the running sequences known, the
  k-th smallest remaining count in full-batch steps (beyond one wave, each further place costs the
  mean remaining over the slots); without it, one full-batch step per ahead / max_num_seqs;
* plus one step at the batch it joins, unit_step_s · g(min(ahead + 1, max_num_seqs)): among
  replicas with free slots the emptier and the faster one wins, and the two trade off.

Replicas with no load known rank last, in the order given (the caller shuffles).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaLoad:
    """What routing knows of one replica (from the controller's view or Serve's polled stats)."""

    running: int
    waiting: int
    max_num_seqs: int
    step_s: float  # recent engine step time (EWMA); 0: not measured yet
    unit_step_s: float  # step time normalized to an empty batch; 0: derive it from step_s
    remaining: tuple[float, ...] = field(default=())  # decode tokens left per running sequence (controller only)


def _slot_wait_steps(place: int, capacity: int, remaining: Sequence[float]) -> float:
    """Steps until the ``place``-th slot (1-based) of a full replica frees."""
    if not remaining:
        return (capacity + place - 1) / capacity
    ordered = sorted(remaining)
    if place <= len(ordered):
        return float(ordered[place - 1])
    mean = sum(ordered) / len(ordered)
    return ordered[-1] + mean * (place - len(ordered)) / capacity


def batch_factor(batch: float, capacity: int) -> float:
    return 1.0 + max(0.0, batch) / max(1, capacity)


def unit_step_s(load: ReplicaLoad) -> float:
    """The replica's step time normalized to an empty batch (reported, or derived from step_s and running)."""
    unit = load.unit_step_s or load.step_s / batch_factor(load.running, max(1, load.max_num_seqs))
    return max(float(unit), 1e-4)


def ahead_of(load: ReplicaLoad, ongoing: int = 0, reserved: int = 0) -> int:
    return max(ongoing, load.running + load.waiting) + reserved


def expected_delay(load: ReplicaLoad, ongoing: int = 0, reserved: int = 0) -> float:
    capacity = max(1, load.max_num_seqs)
    unit = unit_step_s(load)
    ahead = ahead_of(load, ongoing, reserved)
    wait = 0.0
    if ahead >= capacity:
        full_step = unit * batch_factor(capacity, capacity)
        wait = full_step * _slot_wait_steps(ahead - capacity + 1, capacity, load.remaining)
    return wait + unit * batch_factor(min(ahead + 1, capacity), capacity)


Candidate = TypeVar("Candidate", bound=Hashable)


def rank(candidates: Sequence[tuple[Candidate, ReplicaLoad | None, int, int]]) -> list[Candidate]:
    """Candidate ids, soonest first: (id, load or None, ongoing, reserved) each."""
    known = [(expected_delay(s, n, r), i, c) for i, (c, s, n, r) in enumerate(candidates) if s is not None]
    unknown = [c for c, s, _, _ in candidates if s is None]
    return [c for _, _, c in sorted(known, key=lambda x: (x[0], x[1]))] + unknown
