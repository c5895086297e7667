"""Decode-step grants (paper §3.1, §7.3): which sequences may advance in the next engine steps.

A grant is a lease of decode steps. Each control period the ``slots`` highest-π sequences get
their lease renewed to ``lease_steps``; the others keep whatever lease they still hold and are
not renewed, so a sequence that drops out of the top is never cut off mid-lease (no thrashing
between periods). The engine spends one step of a lease each time it advances the sequence; a
running sequence with no lease left is not scheduled (it keeps its KV blocks and resumes in
place when it is granted again). Admission from the waiting queue stays in π order.

``slots=None`` grants everyone (the default, and what replicas use when they fall back to local
control without grant settings): grants then never hold anything back.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GrantPolicy:
    slots: int | None = None  # sequences that may hold a renewed lease at once (per replica)
    lease_steps: int = 8

    def __post_init__(self) -> None:
        if self.slots is not None and self.slots < 1:
            raise ValueError("slots must be at least 1 (or None: everyone)")
        if self.lease_steps < 1:
            raise ValueError("lease_steps must be at least 1")


def to_renew(priorities: dict[str, float], policy: GrantPolicy) -> list[str]:
    """The grant decision of one control period (the controller's, or a replica's when it falls back):
    the top-``slots`` sequences by π."""
    ranked = sorted(priorities, key=lambda k: priorities[k], reverse=True)
    return ranked if policy.slots is None else ranked[: policy.slots]


def renew(priorities: dict[str, float], leases: dict[str, int], policy: GrantPolicy,
          granted: list[str] | None = None) -> dict[str, int]:
    """Leases after one control period: ``granted`` (default: ``to_renew``) renewed, the rest as they
    were; sequences no longer listed in ``priorities`` (finished) dropped."""
    out = {k: leases.get(k, 0) for k in priorities}
    for key in to_renew(priorities, policy) if granted is None else granted:
        if key in out:
            out[key] = policy.lease_steps
    return out


def spend(leases: dict[str, int], advanced: list[str]) -> None:
    """One engine step advanced these sequences: each used one step of its lease."""
    for key in advanced:
        if leases.get(key, 0) > 0:
            leases[key] -= 1


def runnable(keys: list[str], leases: dict[str, int]) -> list[str]:
    """Sequences allowed to advance now. Never empty when ``keys`` is not: if no one holds a lease,
    everyone may run, so the engine cannot stall waiting for a controller."""
    allowed = [k for k in keys if leases.get(k, 0) > 0]
    return allowed or list(keys)
