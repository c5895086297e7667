"""Scheduling priority π(s) of paper §3.1/§7.3, with the aging that makes Prop. 3 hold.

    π(s) = max(E[ΔH_s], ε) / (α·C_s + β·M_s + γ·L_s + δ·R_s) · 2^(w_s / τ_age)

* E[ΔH_s]: predicted irreversible entropy reduction per step (EWMA of ΔH⁺; a prior before
  the first token).
* C_s: compute per step, the context actually attended, in units of ``ref_tokens``.
* M_s: KV memory held, in units of ``ref_blocks``.
* L_s: latency slack, 1 − w_s / SLO clipped to [l_min, 1]: it shrinks as the request waits,
  so urgency raises π through the denominator the paper puts it in.
* R_s (our addition, δ = 0 gives the paper's π): remaining work, the decode tokens the request
  may still generate (its max_tokens minus those generated, at most ``remaining_cap_tokens``: a
  request that leaves max_tokens at the context limit is priced like a long answer, not starved),
  in units of ``ref_output_tokens``.
  C_s prices one step; R_s prices how many steps the slot stays taken. Without it π ranks a
  long free-form generation above a long-context question that needs a dozen tokens, and the
  measured mean latency was worse than FCFS (docs/results/scheduling.md): shortest remaining
  work first is what lowers mean latency in a queue.
* The aging factor doubles π every τ_age seconds waited. The paper's argument for Prop. 3
  (resolved sequences lose priority) does not prevent starvation by itself: a sequence
  whose E[ΔH] stays near 0 could wait forever. With aging, every waiting sequence overtakes
  any competitor after at most ``max_wait_bound`` seconds. Linear aging gives the same
  guarantee with a useless bound (the un-aged π spans ~6 orders of magnitude, so months);
  exponential aging makes it τ_age·log2(π_max/π_min), about two minutes with the defaults.

Pure math: no Ray, no vLLM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PriorityWeights:
    alpha: float = 1.0
    beta: float = 0.5
    gamma: float = 1.0
    aging_s: float = 5.0
    drop_floor: float = 1e-3
    slack_floor: float = 0.05
    ref_tokens: float = 1024.0
    ref_blocks: float = 64.0
    delta: float = 0.0
    ref_output_tokens: float = 128.0
    remaining_cap_tokens: float = 512.0
    srpt: bool = False  # shortest remaining work first: 1 / (1 + R_s), aged; no entropy, cost or slack

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "aging_s", "drop_floor", "slack_floor", "ref_tokens", "ref_blocks",
                     "ref_output_tokens", "remaining_cap_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.delta < 0:
            raise ValueError("delta must be >= 0")


@dataclass(frozen=True)
class SequenceState:
    expected_drop: float
    attended_tokens: float
    kv_blocks: float
    waited_s: float
    slo_s: float
    remaining_tokens: float = 0.0


def latency_slack(waited_s: float, slo_s: float, floor: float) -> float:
    return min(1.0, max(floor, 1.0 - waited_s / slo_s))


def base_priority(s: SequenceState, w: PriorityWeights) -> float:
    if w.srpt:
        return 1.0 / (1.0 + min(s.remaining_tokens, w.remaining_cap_tokens) / w.ref_output_tokens)
    cost = (w.alpha * s.attended_tokens / w.ref_tokens + w.beta * s.kv_blocks / w.ref_blocks
            + w.gamma * latency_slack(s.waited_s, s.slo_s, w.slack_floor)
            + w.delta * min(s.remaining_tokens, w.remaining_cap_tokens) / w.ref_output_tokens)
    return max(s.expected_drop, w.drop_floor) / cost


def priority(s: SequenceState, w: PriorityWeights) -> float:
    return base_priority(s, w) * 2.0 ** (s.waited_s / w.aging_s)


def ewma(previous: float | None, value: float, weight: float) -> float:
    return value if previous is None else (1.0 - weight) * previous + weight * value


def priority_bounds(w: PriorityWeights, max_drop: float, max_tokens: float, max_blocks: float,
                    max_remaining: float = 0.0) -> tuple[float, float]:
    """Bounds of the un-aged π over all states with E[ΔH] ≤ max_drop and the given resources (Prop. 2)."""
    if w.srpt:
        return 1.0 / (1.0 + min(max_remaining, w.remaining_cap_tokens) / w.ref_output_tokens), 1.0
    worst_cost = (w.alpha * max_tokens / w.ref_tokens + w.beta * max_blocks / w.ref_blocks + w.gamma
                  + w.delta * min(max_remaining, w.remaining_cap_tokens) / w.ref_output_tokens)
    best_cost = w.gamma * w.slack_floor
    return w.drop_floor / worst_cost, max(max_drop, w.drop_floor) / best_cost


def max_wait_bound(w: PriorityWeights, max_drop: float, max_tokens: float, max_blocks: float,
                   max_remaining: float = 0.0) -> float:
    """Seconds after which a waiting sequence outranks any sequence that has not waited.

    lo · 2^(t/aging) ≥ hi  ⇔  t ≥ aging · log2(hi/lo).
    """
    lo, hi = priority_bounds(w, max_drop, max_tokens, max_blocks, max_remaining)
    return w.aging_s * math.log2(hi / lo)


def priorities(states: dict[str, SequenceState], w: PriorityWeights) -> dict[str, float]:
    return {key: priority(state, w) for key, state in states.items()}
