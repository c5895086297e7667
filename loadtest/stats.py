"""Summary statistics the benchmarks share, so each result file computes a percentile the same way."""
from __future__ import annotations

from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) of ``values``; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
