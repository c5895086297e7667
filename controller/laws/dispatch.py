"""Late binding: which waiting requests the controller hands to which replica, now (pure).

Requests wait in one cluster-wide queue instead of being pinned to a replica when they arrive. At each
decision the controller knows, per replica, its load (``routing.ReplicaLoad``, from telemetry), what it
has dispatched there and not yet seen in a report (``in_flight``), and its free KV cache in tokens.

* A request is **shed** once its dispatch deadline has passed (the ingress answers it 503 with
  Retry-After): a request that can no longer meet its SLO is not served late.
* The rest are taken in π order (highest first; ties by arrival, then key). Each goes to the replica,
  among those with a free batch slot and room in the KV cache for its prompt, where it is expected to be
  served soonest (``routing.expected_delay``, counting what this decision has already placed there).
  None free: it keeps waiting, and the capacity that frees goes to the highest π first.
* A request whose prompt fits no replica's free KV now may be overtaken by smaller ones, but not for
  ever: it **holds** the replica with the most KV cache in total that can hold it at all — nothing more
  is dispatched there until it fits, so that replica drains towards it. Its wait is bounded by that
  replica's running work, not by the traffic behind it.
* A request that no replica could ever hold (``kv_tokens`` above every replica's whole cache) is shed
  at once (reason ``too_large``): waiting cannot help it.

Pure math: no Ray, no vLLM.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controller.laws.routing import ReplicaLoad, ahead_of, expected_delay


@dataclass(frozen=True, kw_only=True, slots=True)
class QueuedRequest:
    key: str
    pi: float  # cluster-wide π now (aging included)
    arrived_s: float  # when it joined the queue
    deadline_s: float | None  # latest time it may be dispatched; None: no deadline
    kv_tokens: int  # KV cache it needs to start: its prompt's tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaSlots:
    load: ReplicaLoad
    in_flight: int = 0  # dispatched here, not yet in the replica's report
    kv_free_tokens: int  # KV cache free now, in tokens
    kv_total_tokens: int  # the replica's whole KV cache, in tokens


@dataclass(frozen=True, slots=True)
class Dispatch:
    assigned: tuple[tuple[str, str], ...]  # (request key, replica id), in dispatch order
    shed: tuple[tuple[str, str], ...]  # (request key, reason): "deadline" or "too_large"
    waiting: tuple[str, ...]  # still queued, highest π first
    held: Mapping[str, str]  # replica id -> the request key it is held for


def free_slots(slots: ReplicaSlots) -> int:
    return max(0, slots.load.max_num_seqs - ahead_of(slots.load, 0, slots.in_flight))


def dispatch(queue: Sequence[QueuedRequest], replicas: Mapping[str, ReplicaSlots], now_s: float) -> Dispatch:
    largest = max((s.kv_total_tokens for s in replicas.values()), default=0)
    shed: list[tuple[str, str]] = []
    live: list[QueuedRequest] = []
    for request in queue:
        if request.deadline_s is not None and now_s > request.deadline_s:
            shed.append((request.key, "deadline"))
        elif replicas and request.kv_tokens > largest:
            shed.append((request.key, "too_large"))
        else:
            live.append(request)
    live.sort(key=lambda r: (-r.pi, r.arrived_s, r.key))

    placed = dict.fromkeys(replicas, 0)
    kv_free = {rid: s.kv_free_tokens for rid, s in replicas.items()}
    held: dict[str, str] = {}
    assigned: list[tuple[str, str]] = []
    waiting: list[str] = []
    for request in live:
        unheld = [rid for rid in replicas if rid not in held]
        kv_ok = [rid for rid in unheld if kv_free[rid] >= request.kv_tokens]
        fits = [rid for rid in kv_ok if free_slots(replicas[rid]) > placed[rid]]
        if fits:
            best = min(fits, key=lambda rid: (
                expected_delay(replicas[rid].load, 0, replicas[rid].in_flight + placed[rid]), rid))
            placed[best] += 1
            kv_free[best] -= request.kv_tokens
            assigned.append((request.key, best))
            continue
        waiting.append(request.key)
        if not kv_ok:  # waiting for KV cache, not for a slot: hold the biggest replica that can take it
            holders = [rid for rid in unheld if replicas[rid].kv_total_tokens >= request.kv_tokens]
            if holders:
                held[max(holders, key=lambda rid: (replicas[rid].kv_total_tokens, rid))] = request.key
    return Dispatch(tuple(assigned), tuple(shed), tuple(waiting), held)
