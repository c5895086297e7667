"""Post-hoc temperature calibration of paper §5: p_cal(x) ∝ exp(z(x) / T_cal), T_cal fitted on held-out text.

The fit minimises the held-out negative log-likelihood

    NLL(T) = mean_i [ logsumexp(z_i / T) − z_i[y_i] / T ]

over T. With β = 1/T each term is a log-sum-exp of an affine function of β minus a linear
one, so NLL is convex in β: a golden-section search on β finds the global minimum to any
tolerance without gradients. The caller supplies NLL(T) (the torch evaluation lives with the
logits, e.g. ``loadtest.calibration_stress``); this module is pure math.
"""
from __future__ import annotations

import math
from collections.abc import Callable

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def fit_temperature(nll: Callable[[float], float], t_min: float = 0.05, t_max: float = 20.0,
                    tolerance: float = 1e-4) -> float:
    """The T in [t_min, t_max] minimising nll(T) (searched over β = 1/T, where NLL is convex)."""
    if not 0.0 < t_min < t_max:
        raise ValueError(f"need 0 < t_min < t_max, got {t_min}, {t_max}")
    lo, hi = 1.0 / t_max, 1.0 / t_min
    a, b = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    fa, fb = nll(1.0 / a), nll(1.0 / b)
    while hi - lo > tolerance * max(1.0, lo):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - _GOLDEN * (hi - lo)
            fa = nll(1.0 / a)
        else:
            lo, a, fa = a, b, fb
            b = lo + _GOLDEN * (hi - lo)
            fb = nll(1.0 / b)
    return 2.0 / (lo + hi)
