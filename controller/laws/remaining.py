"""Remaining work of a request, predicted from what its replica knows of it now (pure).

π's remaining-work term and the routing law need the decode tokens a request will still generate.
Its output budget (max_tokens minus generated) is an upper bound that real requests rarely reach:
they stop at EOS. This law fits, from finished requests, a ridge regression of

    y = log(1 + tokens still to generate)

on features of a snapshot of the request:

* base: 1, log(1 + prompt tokens), log(1 + budget left), log(1 + generated);
* entropy (with ``entropy=True``): the request's mean token entropy so far, its last token's
  entropy, E[ΔH⁺] (the EWMA of entropy drops that π's numerator uses), and log(10⁻⁴ + the
  probability mass on its stop tokens at its latest step), read from the same distribution. Before
  the first token they are 0, with an indicator that says so.

A prediction is exp(ŷ) − 1 clipped to [0, budget left]. Fitting solves the ridge normal equations
(a few features: plain Gaussian elimination). Pure math: no Ray, no vLLM, no numpy.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_STOP_FLOOR = 1e-4  # stop-token mass below this reads the same: far from the end


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkSnapshot:
    prompt_tokens: int
    budget_left: float  # max_tokens − generated (the cap when max_tokens is unknown)
    generated: int
    mean_entropy: float | None  # None before the first token
    last_entropy: float | None
    expected_drop: float | None
    stop_prob: float | None = None


def features(s: WorkSnapshot, entropy: bool) -> list[float]:
    row = [1.0, math.log1p(s.prompt_tokens), math.log1p(max(0.0, s.budget_left)), math.log1p(s.generated)]
    if entropy:
        seen = s.mean_entropy is not None
        row += [1.0 if seen else 0.0, s.mean_entropy or 0.0, s.last_entropy or 0.0, s.expected_drop or 0.0,
                math.log(_STOP_FLOOR + s.stop_prob) if seen and s.stop_prob is not None else 0.0]
    return row


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b for a symmetric positive definite a (ridge keeps it so), Gaussian elimination with pivoting."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def fit(samples: Sequence[tuple[WorkSnapshot, float]], entropy: bool, ridge: float = 1.0) -> list[float]:
    """Weights from (snapshot, tokens it still generated) pairs; the intercept is not penalized."""
    k = len(features(WorkSnapshot(prompt_tokens=0, budget_left=0, generated=0, mean_entropy=None,
                                  last_entropy=None, expected_drop=None), entropy))
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for snapshot, remaining in samples:
        x = features(snapshot, entropy)
        y = math.log1p(max(0.0, remaining))
        for i in range(k):
            b[i] += x[i] * y
            for j in range(k):
                a[i][j] += x[i] * x[j]
    for i in range(1, k):
        a[i][i] += ridge
    a[0][0] += 1e-9
    return _solve(a, b)


def predict(weights: Sequence[float], s: WorkSnapshot, entropy: bool) -> float:
    y = sum(w * x for w, x in zip(weights, features(s, entropy)))
    return min(max(0.0, s.budget_left), max(0.0, math.expm1(min(y, 30.0))))


def mean_abs_error(samples: Sequence[tuple[WorkSnapshot, float]], weights: Sequence[float] | None,
                   entropy: bool = False) -> float:
    """Mean |predicted − actual| tokens; ``weights`` None: the budget itself (max_tokens − generated)."""
    if not samples:
        return math.nan
    errors = [abs((max(0.0, s.budget_left) if weights is None else predict(weights, s, entropy)) - actual)
              for s, actual in samples]
    return sum(errors) / len(errors)
