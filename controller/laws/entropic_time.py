"""Entropic time (paper §2): tau = sum of the positive entropy drops dH+ = max(0, H_{t-1} - H_t).

``EntropyTrace`` accumulates a sequence's per-token entropies into tau and a running
mean/variance (Welford), so per-request summaries never need the whole trace.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


def positive_drops(entropies: Iterable[float], previous: float | None = None) -> list[float]:
    """dH+_t for each entropy, given the entropy before the first one (None: no drop)."""
    drops = []
    for h in entropies:
        drops.append(0.0 if previous is None else max(0.0, previous - h))
        previous = h
    return drops


def entropic_time(entropies: Iterable[float]) -> float:
    return math.fsum(positive_drops(entropies))


@dataclass
class EntropyTrace:
    tokens: int = 0
    tau: float = 0.0
    last: float | None = None
    _mean: float = 0.0
    _m2: float = field(default=0.0, repr=False)

    def add(self, entropy: float) -> float:
        """Record one token's entropy; returns its dH+."""
        drop = 0.0 if self.last is None else max(0.0, self.last - entropy)
        self.tau += drop
        self.last = entropy
        self.tokens += 1
        delta = entropy - self._mean
        self._mean += delta / self.tokens
        self._m2 += delta * (entropy - self._mean)
        return drop

    @property
    def mean(self) -> float:
        return self._mean if self.tokens else 0.0

    @property
    def variance(self) -> float:
        return self._m2 / self.tokens if self.tokens else 0.0
