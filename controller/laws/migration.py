"""Migration of waiting work: which requests stuck in one replica's queue move to another, now (pure).

A request is bound to a replica when Serve's router sends it there (dispatch off, or the controller
unreachable when it arrived), and then waits in that replica's scheduler however the cluster changes:
the replica it joined may still be full of long generations while another has emptied. A request
that has waited at least ``after_s`` there with nothing computed yet (no prefill, no output: moving it
loses no work and shows the client nothing) is **stranded**; the controller may move it.

* Stranded requests are taken highest π first (ties: longest waited, then key).
* Each goes to the replica with a free batch slot and room in the KV cache for its prompt where it is
  expected to start soonest (``routing.expected_delay``, counting what this
  decision has already moved there), and only if that is sooner than at its own replica, by
  ``min_gain_s``: what resending costs (an abort, a hop through the ingress, a router choice).
  A replica that holds stranded requests itself is no target: its queue is not empty.
* A request moves at most ``max_moves`` times in its life (the caller passes how often it has), so
  two replicas that each look emptier than the other in turn cannot bounce it.

Pure math: no Ray, no vLLM.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controller.laws.dispatch import ReplicaSlots, free_slots
from controller.laws.routing import expected_delay


@dataclass(frozen=True, kw_only=True, slots=True)
class Stranded:
    key: str
    replica_id: str  # where it waits
    waited_s: float  # since it reached that replica
    pi: float
    kv_tokens: int  # KV cache it needs to start: its prompt's tokens
    moves: int = 0  # how often it has moved already


@dataclass(frozen=True, kw_only=True, slots=True)
class MigrationPolicy:
    after_s: float  # a request must have waited this long on its replica to move
    min_gain_s: float = 0.0  # it moves only if it starts at least this much sooner elsewhere
    max_moves: int = 1

    def __post_init__(self) -> None:
        if self.after_s < 0 or self.min_gain_s < 0 or self.max_moves < 0:
            raise ValueError("after_s, min_gain_s and max_moves must be non-negative")


def migrations(stranded: Sequence[Stranded], replicas: Mapping[str, ReplicaSlots],
               policy: MigrationPolicy) -> tuple[tuple[str, str], ...]:
    """(request key, target replica) for each request to move, in decision order."""
    eligible = sorted((s for s in stranded if s.waited_s >= policy.after_s and s.moves < policy.max_moves
                       and s.replica_id in replicas),
                      key=lambda s: (-s.pi, -s.waited_s, s.key))
    sources = {s.replica_id for s in eligible}
    placed = dict.fromkeys(replicas, 0)  # moved to each target in this decision
    left = dict.fromkeys(replicas, 0)  # moved away from each source in this decision
    kv_free = {rid: r.kv_free_tokens for rid, r in replicas.items()}

    def delay(rid: str) -> float:
        r = replicas[rid]
        return expected_delay(r.load, 0, r.in_flight + placed[rid] - left[rid])

    moves: list[tuple[str, str]] = []
    for request in eligible:
        targets = [rid for rid, r in replicas.items() if rid not in sources
                   and free_slots(r) > placed[rid] and kv_free[rid] >= request.kv_tokens]
        if not targets:
            continue
        best = min(targets, key=lambda rid: (delay(rid), rid))
        # Where it is, it waits behind what a new request would find there, less what has moved away.
        if delay(best) + policy.min_gain_s >= delay(request.replica_id):
            continue
        placed[best] += 1
        left[request.replica_id] += 1
        kv_free[best] -= request.kv_tokens
        moves.append((request.key, best))
    return tuple(moves)
