"""Summary statistics the benchmarks share, so each result file computes a percentile the same way."""
from __future__ import annotations

import math
import statistics as st
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


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


def bootstrap_interval(units: Sequence[T], statistic: Callable[[Sequence[T]], float] | None = None,
                       resamples: int = 4000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """(value, low, high): ``statistic`` of ``units`` (default: their mean; units are then numbers) and its
    percentile-bootstrap interval: ``units`` drawn with replacement ``resamples`` times, seeded, so a result
    file recomputes to the same bounds. Paired comparisons pass pairs as units. nan without units."""
    import random

    if not units:
        return (math.nan, math.nan, math.nan)
    stat = statistic or (lambda xs: math.fsum(xs) / len(xs))  # type: ignore[arg-type]
    rng = random.Random(seed)
    draws = sorted(stat(rng.choices(units, k=len(units))) for _ in range(resamples))
    tail = (1 - level) / 2
    return (stat(units), draws[int(tail * (resamples - 1))], draws[int((1 - tail) * (resamples - 1))])


def interval_cell(v: tuple[float, float, float] | list[float], digits: int = 3) -> str:
    """(value, low, high) as a results table prints it: "v [low-high]"."""
    return f"{v[0]:.{digits}f} [{v[1]:.{digits}f}-{v[2]:.{digits}f}]"


def chi2_sf(x2: float, df: int) -> float:
    """P(X > x2) for X ~ chi-square with ``df`` degrees of freedom: Q(df/2, x2/2), the regularised upper
    incomplete gamma (series below a + 1, Lentz's continued fraction above)."""
    a, x = df / 2.0, x2 / 2.0
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def chi_square_p(observed: list[int], probs: list[float], min_expected: float = 0.0) -> float:
    """Pearson's goodness of fit of counts to a distribution over the same categories. Categories expected
    fewer than ``min_expected`` times are pooled into one (Cochran's rule, 5: the chi-square tail is a poor
    approximation for rare categories); probabilities are renormalised when they do not sum to 1."""
    total = sum(probs)
    probs = [p / total for p in probs]
    n = sum(observed)
    rare = [i for i, p in enumerate(probs) if p * n < min_expected]
    if len(rare) == 1 and len(probs) > 2:  # a pool of one is no pool: join the next rarest to it
        rare.append(min((i for i in range(len(probs)) if i not in rare), key=lambda i: probs[i]))
    if len(rare) > 1:
        kept = [i for i in range(len(probs)) if i not in rare]
        observed = [observed[i] for i in kept] + [sum(observed[i] for i in rare)]
        probs = [probs[i] for i in kept] + [sum(probs[i] for i in rare)]
    return chi2_sf(sum((o - p * n) ** 2 / (p * n) for o, p in zip(observed, probs, strict=True)), len(observed) - 1)


def homogeneity_p(a: list[int], b: list[int]) -> float:
    """Two samples' counts over the same categories: the chi-square test that they share one distribution."""
    na, nb = sum(a), sum(b)
    x2 = 0.0
    for oa, ob in zip(a, b, strict=True):
        for observed, n in ((oa, na), (ob, nb)):
            expected = n * (oa + ob) / (na + nb)
            x2 += (observed - expected) ** 2 / expected
    return chi2_sf(x2, len(a) - 1)
