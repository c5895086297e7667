"""Typed messages of the control plane: replica → controller → replica, and controller → router.

Frozen dataclasses with keyword-only fields: a misspelt, missing or unknown field fails where the
message is built, not as a silent default where it is read. They cross processes pickled by Ray
(this module is importable on every node). ``as_json`` gives the debug endpoints' shape.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from controller.laws.priority import SequenceState
from controller.laws.routing import ReplicaLoad

__all__ = ["Admission", "ControllerAnswer", "Grant", "ReplicaLoad", "RoutingView", "SequenceState",
           "SequenceSummary", "TelemetryReport", "as_json"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceSummary:
    """One active request's entropy profile as a person reads it (/debug/requests)."""

    prompt_tokens: int
    generated: int
    max_tokens: int | None
    expected_drop: float | None  # EWMA of ΔH⁺ (nats/token); None before the second token
    last_entropy: float | None
    temperature: float | None
    tau: float  # entropic time so far
    mean_entropy: float
    age_s: float  # since arrival
    idle_s: float  # since its last token
    stop_prob: float | None = None  # probability mass on its stop tokens (EOS included) at its latest step


@dataclass(frozen=True, kw_only=True, slots=True)
class TelemetryReport:
    """What a replica tells the controller every control period (``sequences``: the inputs of π)."""

    replica_id: str
    node_id: str
    sent_at: float  # the replica's wall clock; the controller measures lag with its own
    sequences: dict[str, SequenceState]
    summaries: dict[str, SequenceSummary]
    load: ReplicaLoad
    routing_stats_polls: int  # how often Serve has polled this replica's routing stats
    leases: dict[str, int] | None  # decode steps left per request key (grants on), else None
    kv_free_tokens: int  # KV cache free now (cached prefixes nobody holds count as free), in tokens
    kv_total_tokens: int  # the whole KV cache, in tokens
    finished: dict[str, int]  # key -> tokens generated, of requests that ended (EOS, stop, max_tokens) since the last report
    metrics: list[Any] | None = None  # the replica's Prometheus metric families, once a second
    # key -> seconds waited here, of requests waiting in the engine's queue with nothing computed yet (movable)
    unstarted: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class ControllerAnswer:
    """The controller's decisions for the sequences of one report."""

    priorities: dict[str, float]  # π per request key
    granted: tuple[str, ...] | None = None  # keys whose decode-step lease is renewed (grants on)
    moves: dict[str, str] | None = None  # key -> replica id: unstarted requests to hand back for that replica (migration on)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutingView:
    """Each live replica's load as the controller last heard it, and how long ago that was."""

    loads: dict[str, ReplicaLoad]
    ages_s: dict[str, float]


@dataclass(frozen=True, kw_only=True, slots=True)
class Admission:
    """A new request asking the controller's queue for a replica (ingress → controller)."""

    key: str  # the request's key in the replica's telemetry once it runs there
    prompt_tokens: int  # estimated by the ingress, which holds no tokenizer
    max_tokens: int | None
    waited_s: float = 0.0  # already waited in an earlier controller's queue (resent after a restart)
    max_wait_s: float  # how long it may wait for a replica before it is shed
    compute_factor: float = 1.0  # engine tokens per output token it may spend (EPIC: its rollouts); prices C_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Grant:
    """The controller's answer to an ``Admission``: the replica to send it to, or why not."""

    key: str
    replica_id: str | None  # None: not dispatched (see ``shed``)
    shed: str | None = None  # "queue_full", "deadline": answer 503; "too_large": let a replica's engine judge it
    waited_s: float = 0.0


def as_json(message: Any) -> Any:
    """A message (or a structure of them) as JSON-ready dicts and lists."""
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return {f.name: as_json(getattr(message, f.name)) for f in dataclasses.fields(message)}
    if isinstance(message, dict):
        return {k: as_json(v) for k, v in message.items()}
    if isinstance(message, (list, tuple)):
        return [as_json(v) for v in message]
    return message
