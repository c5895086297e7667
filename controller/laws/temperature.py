"""Entropy-stabilized sampling temperature (paper §3.3, §5, §7.2), with the sign corrected.

The paper prints T <- T * exp(+eta (H - H*)). Entropy rises with temperature, so that
law raises T when entropy is already too high: positive feedback that runs to a clip
bound. The law implemented here is

    T <- clip(T * exp(-eta * (H_hat - H*)), T_min, T_max)

with the per-step change of log T bounded by ``max_log_step`` (§5 guard (iii)), so one
outlier estimate cannot swing the temperature across its whole range.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from controller.laws.priority import ewma

CORRECTED_SIGN = -1.0
PAPER_SIGN = +1.0


@dataclass(frozen=True)
class TemperatureLaw:
    target_entropy: float
    eta: float
    t_min: float
    t_max: float
    max_log_step: float = math.inf
    sign: float = CORRECTED_SIGN

    def __post_init__(self) -> None:
        if not 0.0 < self.t_min <= self.t_max:
            raise ValueError(f"need 0 < t_min <= t_max, got {self.t_min}, {self.t_max}")
        if self.eta < 0 or self.max_log_step <= 0:
            raise ValueError("eta must be >= 0 and max_log_step > 0")


def next_temperature(t: float, entropy: float, law: TemperatureLaw) -> float:
    """One step of the law for one sequence."""
    log_step = law.sign * law.eta * (entropy - law.target_entropy)
    log_step = min(max(log_step, -law.max_log_step), law.max_log_step)
    return min(max(t * math.exp(log_step), law.t_min), law.t_max)


def smoothed_entropy(previous: float | None, entropy: float, alpha: float) -> float:
    """EMA of the entropy estimate used as the control input (alpha=1: no smoothing)."""
    return entropy if alpha >= 1.0 else ewma(previous, entropy, alpha)
