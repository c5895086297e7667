"""Entropy-aligned decoding (EPIC): the math of one exact draw, the lookahead estimate and α's fit.

EPIC samples token y from the model's next-token distribution tilted by the entropy of the
continuation y leads to:

    q_α(y | y_<t) ∝ q(y | y_<t) · exp(−α · H_{t:t+k}(y))

Gumbel-Max turns the draw into an argmax of s_i = z_i − α·H_i, with z_i = logit_i + G_i and G_i
i.i.d. Gumbel(0, 1). The lookahead entropies H_i cost rollouts, so the argmax is found lazily
(paper §4, Algorithm 1): every candidate carries bounds L_i ≤ H_i ≤ U_i, hence bounds on s_i; a
candidate whose best case is below another's worst case can never win, and candidates are
evaluated in descending order of their best case until the best evaluated score is at least every
remaining best case. The result is the exact argmax of the scores given the estimated entropies,
hence an exact sample of q_α with H replaced by its estimate, whatever the bounds are, as long as
they hold.

Bounds: a step's entropy lies in [0, log V], so H_{t:t+k} in [0, k·log V] (admissible for every
model); once a candidate's first lookahead step is computed, H = h_1 + H_{t+1:t+k} with the rest in
[0, (k−1)·log V]. ``step_max`` may replace log V by a smaller per-step ceiling observed for the
model (the paper's "tighter bounds"); then exactness holds only where that ceiling does.

The lookahead estimate is the paper's Rao-Blackwellised one (Appendix B.2): the sum over the k
steps of the mean, over rollouts, of each step's exact entropy, which has no more variance than the
Monte Carlo mean of the rollouts' surprisal.

α is fitted by moment matching (Appendix B.1): the cross-entropy of held-out text under q_α is
convex in α with derivative μ_p − μ_α, where μ_p is the reference's mean entropy statistic and
μ_α = E_q[H e^{−αH}] / E_q[e^{−αH}] (importance weights over samples of q) is nonincreasing in α,
so α* is found by bisection.

Pure math: no engine, no tensors. The engine side (rollouts through vLLM) calls these.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def rao_blackwell_lookahead(step_entropies: Sequence[Sequence[float]]) -> float:
    """Ĥ^RB = Σ_j (1/K) Σ_i H(Y_{t+j} | y^{(i)}_{≤t+j−1}) from K rollouts' per-step exact entropies
    ([K][steps]). A rollout that ended early (EOS) contributes 0 for its missing steps: nothing more is
    generated, so nothing more is uncertain."""
    if not step_entropies:
        raise ValueError("need at least one rollout")
    k = len(step_entropies)
    steps = max(len(r) for r in step_entropies)
    return sum(sum(r[j] for r in step_entropies if j < len(r)) / k for j in range(steps))


def monte_carlo_lookahead(surprisals: Sequence[Sequence[float]]) -> float:
    """The plain estimate the Rao-Blackwellised one replaces: the rollouts' mean total surprisal
    −log q(y_{t+1:t+k} | y_≤t) ([K][steps] per-token surprisal)."""
    if not surprisals:
        raise ValueError("need at least one rollout")
    return sum(sum(r) for r in surprisals) / len(surprisals)


def entropy_bounds(horizon: int, vocab_size: int, first_step: float | None = None,
                   step_max: float | None = None) -> tuple[float, float]:
    """[L, U] on H_{t:t+k}: each step's entropy in [0, step_max] (log V unless a smaller ceiling is
    given); with the first step's entropy known, the rest of the horizon is what is unknown."""
    ceiling = math.log(vocab_size) if step_max is None else step_max
    if first_step is None:
        return 0.0, horizon * ceiling
    return first_step, first_step + (horizon - 1) * ceiling


def score_bounds(perturbed: float, lower: float, upper: float, alpha: float) -> tuple[float, float]:
    """[lo, hi] of s = perturbed − α·H for H in [lower, upper]; α may be negative (favouring entropy)."""
    if alpha >= 0:
        return perturbed - alpha * upper, perturbed - alpha * lower
    return perturbed - alpha * lower, perturbed - alpha * upper


@dataclass
class LazyArgmax:
    index: int  # position in the candidate list of the argmax of s_i
    score: float  # s_index; only a lower bound when nothing was evaluated
    evaluated: list[int] = field(default_factory=list)  # candidates whose entropy was estimated, in order
    survivors: int = 0  # candidates left after the bound test, before any evaluation
    exact: bool = True  # false: max_evaluations stopped the search before the bounds settled it


class LazySearch:
    """The lazy argmax as a state machine, so that evaluations can be awaited (rollouts through an
    engine): ``pending()`` names the next candidates to evaluate (best case first) or None when the
    answer is settled; ``record`` takes their entropies; ``result`` is the answer so far.

    argmax_i perturbed_i − α·H_i, with lower_i ≤ H_i ≤ upper_i required of the recorded estimates. With
    ``max_evaluations``, the search stops there and returns the best evaluated candidate, flagged inexact
    if an unevaluated one could still have won."""

    def __init__(self, perturbed: Sequence[float], lower: Sequence[float], upper: Sequence[float], alpha: float,
                 batch: int = 1, max_evaluations: int | None = None) -> None:
        n = len(perturbed)
        if n == 0 or len(lower) != n or len(upper) != n:
            raise ValueError("need one perturbed score and one bound pair per candidate")
        if batch < 1 or (max_evaluations is not None and max_evaluations < 1):
            raise ValueError("batch and max_evaluations must be >= 1")
        self._perturbed, self._alpha, self._batch = list(perturbed), alpha, batch
        self._position = 0
        if alpha == 0.0:  # the tilt vanishes: plain Gumbel-Max
            best = max(range(n), key=lambda i: perturbed[i])
            self._alive: list[int] = []
            self._hi: list[float] = []
            self.result = LazyArgmax(best, perturbed[best], [], 1)
            self.contenders = frozenset({best})
            self._budget = 0
            return
        bounds = [score_bounds(perturbed[i], lower[i], upper[i], alpha) for i in range(n)]
        floor = max(lo for lo, _ in bounds)
        self._alive = sorted((i for i in range(n) if bounds[i][1] >= floor), key=lambda i: -bounds[i][1])
        self._hi = [bounds[i][1] for i in range(n)]
        self.contenders = frozenset(self._alive)  # those the bounds alone could not rule out
        self.result = LazyArgmax(self._alive[0], -math.inf, [], len(self._alive))
        if len(self._alive) == 1:
            self.result.score = bounds[self._alive[0]][0]
            self._alive = []
        self._budget = len(self._alive) if max_evaluations is None else max_evaluations

    def pending(self) -> list[int] | None:
        if self._position >= len(self._alive) or self.result.score >= self._hi[self._alive[self._position]]:
            return None  # nothing left unevaluated can beat what has been seen
        if self._position >= self._budget:
            self.result.exact = False
            return None
        return self._alive[self._position:min(self._position + self._batch, self._budget)]

    def record(self, ids: Sequence[int], entropies: Sequence[float]) -> None:
        for i, h in zip(ids, entropies, strict=True):
            self.result.evaluated.append(i)
            s = self._perturbed[i] - self._alpha * h
            if s > self.result.score:
                self.result.index, self.result.score = i, s
        self._position += len(ids)


def lazy_argmax(perturbed: Sequence[float], lower: Sequence[float], upper: Sequence[float], alpha: float,
                evaluate: Callable[[list[int]], list[float]], batch: int = 1,
                max_evaluations: int | None = None) -> LazyArgmax:
    """``LazySearch`` driven to its end with a synchronous ``evaluate`` (candidates -> their H)."""
    search = LazySearch(perturbed, lower, upper, alpha, batch, max_evaluations)
    while (ids := search.pending()) is not None:
        search.record(ids, evaluate(ids))
    return search.result


def expected_contenders(probs: Sequence[float], width: float) -> float:
    """E[#{i : z_i > max_j z_j − width}] for Gumbel-perturbed log-probabilities: Σ_i a_i e^w / (1 + a_i(e^w − 1)).

    The others' maximum max_{j≠i} z_j is Gumbel located at log(1 − a_i), so token i is within w of the
    maximum with probability a_i e^w / (a_i e^w + 1 − a_i). The paper's Lemma 4.1 (eq. 32) prints
    a_i e^w / (1 + a_i e^w), which leaves out the −a_i (it treats the maximum as independent of z_i) and
    undercounts where one token has most of the mass; its bound, fewer than e^w, still holds (Jensen on the
    concave summand gives n e^w / (n + e^w − 1))."""
    scale = math.exp(width)
    return sum(a * scale / (1.0 + a * (scale - 1.0)) for a in probs)


def tilted_probabilities(logprobs: Sequence[float], lookahead: Sequence[float], alpha: float) -> list[float]:
    """q_α over a candidate set, exhaustively: softmax(log q_i − α·H_i). The reference the lazy draw is
    tested against."""
    scores = [lp - alpha * h for lp, h in zip(logprobs, lookahead, strict=True)]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


# --- α* (Appendix B.1) -------------------------------------------------------------------------------
def tilted_mean(statistics: Sequence[float], alpha: float) -> float:
    """μ_α = Σ H_i e^{−αH_i} / Σ e^{−αH_i} over samples of q (self-normalised importance sampling)."""
    if not statistics:
        raise ValueError("need samples")
    exponents = [-alpha * h for h in statistics]
    top = max(exponents)
    weights = [math.exp(e - top) for e in exponents]
    return sum(w * h for w, h in zip(weights, statistics)) / sum(weights)


def effective_sample_size(statistics: Sequence[float], alpha: float) -> float:
    """Kish's effective sample size of the importance weights e^{−αH}: how many of the samples μ_α still
    rests on (an α whose ESS is a handful is extrapolated, not fitted)."""
    exponents = [-alpha * h for h in statistics]
    top = max(exponents)
    weights = [math.exp(e - top) for e in exponents]
    return sum(weights) ** 2 / sum(w * w for w in weights)


@dataclass(frozen=True)
class AlphaFit:
    alpha: float
    reference_mean: float  # μ_p
    model_mean: float  # μ_0: the untilted model's mean statistic
    fitted_mean: float  # μ_α at the fitted α
    effective_samples: float  # of the importance weights (sequence fit); the positions (position fit)
    iterations: int
    clipped: bool  # the root lies outside [lo, hi]; alpha is the nearer end


def _root(g: Callable[[float], float], lo: float, hi: float, tol: float, max_iter: int) -> tuple[float, int, bool]:
    """The root of a nondecreasing g in [lo, hi] by bisection: (α, iterations, clipped)."""
    if not lo < hi:
        raise ValueError("need lo < hi")
    g_lo, g_hi = g(lo), g(hi)
    if g_lo == 0.0 == g_hi:  # g cannot tell α apart (no spread): no tilt
        return 0.0, 0, False
    if g_lo >= 0:
        return lo, 0, g_lo > 0
    if g_hi <= 0:
        return hi, 0, g_hi < 0
    a, b, iterations = lo, hi, 0
    while b - a > tol and iterations < max_iter:
        mid = 0.5 * (a + b)
        if g(mid) < 0:
            a = mid
        else:
            b = mid
        iterations += 1
    return 0.5 * (a + b), iterations, False


def fit_alpha(reference: Sequence[float], samples: Sequence[float], lo: float = -5.0, hi: float = 5.0,
              tol: float = 1e-6, max_iter: int = 200) -> AlphaFit:
    """α* with μ_α = μ_p, by bisection on g(α) = μ_p − μ_α (nondecreasing in α), sequence-level as the
    paper's Appendix B.1 writes it.

    ``reference``: the entropy statistic of held-out text (μ_p is its mean); ``samples``: the same
    statistic of the model's own samples (q), which the importance weights tilt."""
    if not reference or not samples:
        raise ValueError("need reference and model samples")
    mu_p = sum(reference) / len(reference)
    alpha, iterations, clipped = _root(lambda a: mu_p - tilted_mean(samples, a), lo, hi, tol, max_iter)
    return AlphaFit(alpha=alpha, reference_mean=mu_p, model_mean=tilted_mean(samples, 0.0),
                    fitted_mean=tilted_mean(samples, alpha), effective_samples=effective_sample_size(samples, alpha),
                    iterations=iterations, clipped=clipped)


@dataclass(frozen=True)
class Position:
    """One position t of held-out text: the lookahead entropy H_{t:t+k} of the token the text has there,
    and q's candidates at t (log-probabilities over the support, lookahead entropy of each)."""

    data_lookahead: float
    logprobs: Sequence[float]
    lookaheads: Sequence[float]


def position_mean(position: Position, alpha: float) -> float:
    """E_{y ~ q_α}[H_{t:t+k}(y)] at one position: exact over its candidates, no importance weights."""
    weights = tilted_probabilities(position.logprobs, position.lookaheads, alpha)
    return sum(w * h for w, h in zip(weights, position.lookaheads))


def fit_alpha_positions(positions: Sequence[Position], lo: float = -5.0, hi: float = 5.0, tol: float = 1e-6,
                        max_iter: int = 200) -> AlphaFit:
    """α* of Lemma 3.2 token by token: prefixes from held-out text (p), the next token from q_α, so
    μ_α = mean_t E_{q_α}[H_{t:t+k}] against μ_p = mean_t H_{t:t+k}(y_t of the text). Each position's
    expectation is a finite sum over its candidates, so μ_α is exact for the estimated entropies and
    nonincreasing in α (its derivative is minus a mean of variances)."""
    if not positions:
        raise ValueError("need positions")
    mu_p = sum(p.data_lookahead for p in positions) / len(positions)

    def mu(a: float) -> float:
        return sum(position_mean(p, a) for p in positions) / len(positions)

    alpha, iterations, clipped = _root(lambda a: mu_p - mu(a), lo, hi, tol, max_iter)
    return AlphaFit(alpha=alpha, reference_mean=mu_p, model_mean=mu(0.0), fitted_mean=mu(alpha),
                    effective_samples=float(len(positions)), iterations=iterations, clipped=clipped)
