"""How many KV-cache blocks a decoding sequence attends to (paper §3.2, guards of §3.3 and §5).

The paper keeps B_t = {b | I_b >= theta_t} with theta_t set by the entropy regime. The
attention kernel needs the *number* of kept blocks to size its work once per step (it is
shared by every layer), so the law here sets K_t, the size of B_t, and the worker keeps the
K_t blocks of highest I_b: that is B_t with theta_t the K_t-th largest I_b.

Two budgets. ``fixed`` (the deployment default): f_t = keep_min from the first
decode step, whatever the entropy. ``entropy`` (the paper's law): the keep fraction follows the entropy
regime, with the §5 guards:

    H_eff = max(H_hat + eps_H, H_min)             # conservative entropy used for pruning
    f*    = f_min + (1 - f_min) * clip((H_eff - H_low) / (H_high - H_low), 0, 1)
    f_t   = clip(f*, f_{t-1} - max_step, f_{t-1} + max_step)  # bounded rate of change
    K_t   = clip(ceil(f_t * N), max(B_min, 2), N)             # sink + current block always in

* Low entropy (the model is confident) prunes hard, high entropy attends to everything.
* eps_H: the estimator's error bound; the paper's floor H_hat - eps_H caps the threshold,
  and the conservative reading of it is to prune as if entropy were at the top of its error
  interval, so an underestimate cannot prune more.
* H_min: an entropy below it is treated as H_min, so overconfidence (§6.2) cannot push the
  budget below f(H_min).
* The rate bound starts from "everything kept" (f_{-1} = 1): a sequence sheds blocks
  gradually after its prompt rather than at once.
* Contexts shorter than ``min_context_tokens`` stay dense: with few blocks the selection
  costs more than it saves.

Why a fixed budget is the default: at the same mean kept fraction, with the same block scores, the
entropy-driven budget lost more fidelity to dense than a fixed one on every budget measured
(``make bench-selectors``; docs/results/README.md, "What entropy adds to pruning").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Budget = Literal["fixed", "entropy"]


@dataclass(frozen=True)
class PruningLaw:
    budget: Budget = "fixed"
    keep_min: float = 0.5
    entropy_low: float = 0.5
    entropy_high: float = 3.0
    epsilon_h: float = 0.0
    entropy_min: float = 0.0
    min_blocks: int = 4
    max_step: float = 0.1
    min_context_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.budget not in ("fixed", "entropy"):
            raise ValueError(f"budget must be 'fixed' or 'entropy', got {self.budget!r}")
        if not 0.0 < self.keep_min <= 1.0:
            raise ValueError(f"keep_min must be in (0, 1], got {self.keep_min}")
        if not self.entropy_low < self.entropy_high:
            raise ValueError("entropy_low must be below entropy_high")
        if self.epsilon_h < 0 or self.max_step <= 0 or self.min_blocks < 2 or self.min_context_tokens < 0:
            raise ValueError("need epsilon_h >= 0, max_step > 0, min_blocks >= 2, min_context_tokens >= 0")


def target_keep_fraction(entropy: float, law: PruningLaw) -> float:
    """f* for one sequence whose smoothed entropy estimate is ``entropy`` (nats)."""
    if law.budget == "fixed":
        return law.keep_min
    if math.isnan(entropy):
        return 1.0  # no estimate yet: attend to everything
    h_eff = max(entropy + law.epsilon_h, law.entropy_min)
    x = (h_eff - law.entropy_low) / (law.entropy_high - law.entropy_low)
    return law.keep_min + (1.0 - law.keep_min) * min(max(x, 0.0), 1.0)


def next_keep_fraction(previous: float | None, entropy: float, law: PruningLaw) -> float:
    """f_t: the target, moved at most ``max_step`` from the previous step's fraction (a fixed budget
    holds from the first decode step: that is how it was measured against the entropy law)."""
    if law.budget == "fixed":
        return law.keep_min
    prev = 1.0 if previous is None else previous
    target = target_keep_fraction(entropy, law)
    return min(max(target, prev - law.max_step), prev + law.max_step)


def blocks_to_keep(num_blocks: int, context_tokens: int, fraction: float, law: PruningLaw) -> int:
    """K_t for a sequence holding ``num_blocks`` blocks; equal to num_blocks means dense."""
    if context_tokens < law.min_context_tokens or num_blocks <= 2:
        return num_blocks
    k = math.ceil(fraction * num_blocks - 1e-9)
    return min(max(k, law.min_blocks, 2), num_blocks)
