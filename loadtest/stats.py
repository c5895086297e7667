"""Summary statistics the benchmarks share, so each result file computes a percentile the same way."""
from __future__ import annotations

import math
import statistics as st
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) of ``values``; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (stays inside [0, 1], unlike the normal one)."""
    if n == 0:
        return (math.nan, math.nan)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_interval(values: Iterable[float], z: float = 1.96) -> tuple[float, float, float]:
    """(mean, low, high): the 95% normal interval of the mean of ``values`` (nan ignored; the bounds are nan
    with fewer than two values)."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return (math.nan, math.nan, math.nan)
    m = st.fmean(kept)
    half = z * st.stdev(kept) / math.sqrt(len(kept)) if len(kept) > 1 else math.nan
    return (m, m - half, m + half)
