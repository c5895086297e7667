"""EPIC's pure math (controller/laws/epic.py): the lazy exact argmax, its bounds, the Rao-Blackwellised
lookahead estimate and α's fit, against brute force; and the bounds and the lazy draw on the default
model's real next-token distributions and rollouts (transformers, not the serving engine)."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.laws.epic import (
    Position,
    entropy_bounds,
    expected_contenders,
    fit_alpha,
    fit_alpha_positions,
    lazy_argmax,
    monte_carlo_lookahead,
    position_mean,
    rao_blackwell_lookahead,
    score_bounds,
    tilted_mean,
    tilted_probabilities,
)
from loadtest.stats import chi_square_p


def gumbel(rng: random.Random) -> float:
    return -math.log(-math.log(rng.random() or 1e-300))


# --- the lazy argmax --------------------------------------------------------------------------------
candidates = st.integers(min_value=1, max_value=12).flatmap(lambda n: st.tuples(
    st.lists(st.floats(-20, 20), min_size=n, max_size=n),  # perturbed logits
    st.lists(st.floats(0, 8), min_size=n, max_size=n),  # true H
    st.lists(st.floats(0, 3), min_size=n, max_size=n),  # slack below H
    st.lists(st.floats(0, 3), min_size=n, max_size=n),  # slack above H
))


@settings(max_examples=300, deadline=None)
@given(candidates, st.floats(-2, 2), st.integers(1, 4))
def test_lazy_argmax_is_the_exhaustive_argmax_whatever_the_bounds(case, alpha, batch):
    perturbed, h, below, above = case
    lower = [x - b for x, b in zip(h, below)]
    upper = [x + a for x, a in zip(h, above)]
    calls: list[list[int]] = []

    def evaluate(ids: list[int]) -> list[float]:
        calls.append(ids)
        return [h[i] for i in ids]

    result = lazy_argmax(perturbed, lower, upper, alpha, evaluate, batch=batch)
    scores = [z - alpha * x for z, x in zip(perturbed, h)]
    assert scores[result.index] == max(scores)
    assert result.exact
    assert len(result.evaluated) == len(set(result.evaluated)) <= result.survivors <= len(perturbed)
    assert all(len(c) <= batch for c in calls)
    if result.evaluated:
        assert result.score == pytest.approx(scores[result.index])


def test_nothing_is_evaluated_when_the_bounds_settle_it_and_inexact_is_flagged():
    def never(ids):
        raise AssertionError("evaluated")

    # one front-runner 10 above the rest; α·(U−L) = 4 cannot close the gap
    result = lazy_argmax([10.0, 0.0, -1.0], [0, 0, 0], [4, 4, 4], 1.0, never)
    assert (result.index, result.survivors, result.evaluated) == (0, 1, [])
    # two contenders: the search needs both, a budget of one stops it inexact
    capped = lazy_argmax([1.0, 0.9], [0, 0], [4, 4], 1.0, lambda ids: [3.0 for _ in ids], max_evaluations=1)
    assert not capped.exact and capped.evaluated == [0]


def test_score_bounds_follow_the_sign_of_alpha():
    assert score_bounds(1.0, 0.5, 2.0, 0.5) == (0.0, 0.75)
    assert score_bounds(1.0, 0.5, 2.0, -0.5) == (1.25, 2.0)
    assert entropy_bounds(4, 100) == (0.0, 4 * math.log(100))
    assert entropy_bounds(4, 100, first_step=1.5) == (1.5, 1.5 + 3 * math.log(100))
    assert entropy_bounds(4, 100, step_max=2.0) == (0.0, 8.0)


def _draws(logprobs, lookahead, alpha, n, seed, width):
    """n lazy EPIC draws over a fixed candidate set; bounds are the true H ± width/2."""
    rng = random.Random(seed)
    counts = [0] * len(logprobs)
    evaluations = 0
    lower = [h - width / 2 for h in lookahead]
    upper = [h + width / 2 for h in lookahead]
    for _ in range(n):
        perturbed = [lp + gumbel(rng) for lp in logprobs]
        result = lazy_argmax(perturbed, lower, upper, alpha, lambda ids: [lookahead[i] for i in ids])
        counts[result.index] += 1
        evaluations += len(result.evaluated)
    return counts, evaluations


def test_lazy_draws_follow_the_tilted_distribution_and_alpha_zero_is_the_model():
    logprobs = [math.log(p) for p in (0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02)]
    lookahead = [3.0, 0.5, 2.0, 1.0, 4.0, 0.2, 2.5]
    n = 20000
    for alpha in (0.0, 0.7, -0.4):
        counts, evaluations = _draws(logprobs, lookahead, alpha, n, seed=1, width=0.5)
        expected = tilted_probabilities(logprobs, lookahead, alpha)
        p = chi_square_p(counts, expected)
        assert p > 1e-3, (alpha, counts, expected, p)
        # exhaustive evaluation would cost len(candidates) per draw
        print(f"alpha {alpha}: p {p:.3f}, evaluated {evaluations / n:.2f} of {len(logprobs)} per draw")
        assert evaluations < 0.5 * n * len(logprobs), (alpha, evaluations / n)
    assert tilted_probabilities(logprobs, lookahead, 0.0) == pytest.approx([math.exp(x) for x in logprobs])


def test_the_number_of_contenders_matches_lemma_4_1():
    rng = random.Random(3)
    probs = [0.5, 0.2, 0.1, 0.1, 0.05, 0.05]
    width = 1.0
    n = 20000
    total = 0
    for _ in range(n):
        z = [math.log(p) + gumbel(rng) for p in probs]
        top = max(z)
        total += sum(1 for x in z if x > top - width)
    expected = expected_contenders(probs, width)
    # per draw the count lies in [1, 6]: its standard deviation is at most 2.5, so 4 standard errors
    assert total / n == pytest.approx(expected, abs=4 * 2.5 / math.sqrt(n))
    assert expected < math.exp(width)
    # the paper's eq. 32 (no −a_i) is off by more than that here
    printed = sum(a * math.exp(width) / (1 + a * math.exp(width)) for a in probs)
    assert abs(total / n - printed) > 4 * 2.5 / math.sqrt(n)


# --- the lookahead estimate ---------------------------------------------------------------------------
def _chain(seed: int, vocab: int = 4):
    rng = random.Random(seed)
    rows = []
    for _ in range(vocab):
        w = [math.exp(2 * rng.gauss(0, 1)) for _ in range(vocab)]
        rows.append([x / sum(w) for x in w])
    return rows


def _h(row):
    return -sum(p * math.log(p) for p in row if p > 0)


def _exact_lookahead(chain, token, k):
    dist = [1.0 if s == token else 0.0 for s in range(len(chain))]
    total = 0.0
    for _ in range(k):
        total += sum(d * _h(chain[s]) for s, d in enumerate(dist))
        dist = [sum(dist[s] * chain[s][u] for s in range(len(chain))) for u in range(len(chain))]
    return total


def _rollout(chain, token, k, rng):
    entropies, surprisals, state = [], [], token
    for _ in range(k):
        row = chain[state]
        entropies.append(_h(row))
        nxt = rng.choices(range(len(row)), weights=row)[0]
        surprisals.append(-math.log(row[nxt]))
        state = nxt
    return entropies, surprisals


def test_rao_blackwell_estimate_is_unbiased_with_less_variance_than_monte_carlo():
    chain = _chain(0)
    rng = random.Random(0)
    k, reps = 4, 4000
    for token in range(len(chain)):
        exact = _exact_lookahead(chain, token, k)
        rb, mc = [], []
        for _ in range(reps):
            e, s = _rollout(chain, token, k, rng)
            rb.append(rao_blackwell_lookahead([e]))
            mc.append(monte_carlo_lookahead([s]))
        mean_rb, mean_mc = sum(rb) / reps, sum(mc) / reps
        var_rb = sum((x - mean_rb) ** 2 for x in rb) / (reps - 1)
        var_mc = sum((x - mean_mc) ** 2 for x in mc) / (reps - 1)
        assert mean_rb == pytest.approx(exact, abs=5 * math.sqrt(var_rb / reps) + 1e-9)
        assert mean_mc == pytest.approx(exact, abs=5 * math.sqrt(var_mc / reps))
        assert var_rb < var_mc


def test_rao_blackwell_averages_rollouts_per_step_and_ended_rollouts_add_nothing():
    assert rao_blackwell_lookahead([[1.0, 2.0], [3.0, 4.0]]) == pytest.approx(2.0 + 3.0)
    assert rao_blackwell_lookahead([[1.0, 2.0], [3.0]]) == pytest.approx(2.0 + 1.0)
    with pytest.raises(ValueError):
        rao_blackwell_lookahead([])


# --- α* ---------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 30), min_size=2, max_size=30), st.floats(-3, 3), st.floats(0.01, 2))
def test_tilted_mean_is_nonincreasing_in_alpha(samples, alpha, step):
    assert tilted_mean(samples, alpha + step) <= tilted_mean(samples, alpha) + 1e-9


def test_fit_alpha_recovers_the_tilt_that_made_the_reference():
    rng = random.Random(5)
    samples = [rng.gammavariate(4.0, 1.0) for _ in range(4000)]  # the model's statistic under q
    for true_alpha in (-0.3, 0.0, 0.4):
        fit = fit_alpha([tilted_mean(samples, true_alpha)], samples, lo=-2, hi=2)
        assert fit.alpha == pytest.approx(true_alpha, abs=1e-4)
        assert fit.fitted_mean == pytest.approx(fit.reference_mean, abs=1e-4)  # alpha to 1e-6 x variance ~4
        assert not fit.clipped and fit.effective_samples > 100
    beyond = fit_alpha([0.01], samples, lo=-2, hi=2)  # a mean no tilt in range reaches
    assert beyond.clipped and beyond.alpha == 2
    assert fit_alpha([3.0], [3.0, 3.0]).alpha == 0.0


def test_the_position_fit_recovers_the_tilt_whose_expectations_made_the_text():
    rng = random.Random(9)
    positions = []
    for _ in range(50):
        logits = [rng.gauss(0, 2) for _ in range(6)]
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        positions.append(Position(0.0, [x - norm for x in logits], [rng.uniform(0, 12) for _ in range(6)]))
    for true_alpha in (-0.2, 0.0, 0.35):
        made = [Position(position_mean(p, true_alpha), p.logprobs, p.lookaheads) for p in positions]
        fit = fit_alpha_positions(made, lo=-2, hi=2)
        assert fit.alpha == pytest.approx(true_alpha, abs=1e-5) and not fit.clipped
        assert fit.fitted_mean == pytest.approx(fit.reference_mean, abs=1e-4)
    assert fit_alpha_positions([Position(20.0, [0.0], [3.0])], lo=-2, hi=2).clipped  # one candidate: no tilt moves it
    lows = [Position(0.0, p.logprobs, p.lookaheads) for p in positions]  # below every candidate: the upper end
    assert fit_alpha_positions(lows, lo=-2, hi=2).clipped


# --- on the default model ---------------------------------------------------------------------------
def test_bounds_hold_and_the_lazy_draw_is_exact_on_real_rollouts(hf_model):
    """Real next-token distributions and lookahead entropies of SmolLM2: every estimate lies inside the
    bounds the draw relies on, and lazy draws match q_α over the top candidates, computed exhaustively,
    while evaluating far fewer of them."""
    import torch

    model, tokenizer = hf_model
    torch.manual_seed(0)
    prefix = tokenizer("The weather today is", return_tensors="pt").input_ids
    k, top, rollouts = 3, 8, 2
    with torch.no_grad():
        logits = model(prefix).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, -1)
        ids = logprobs.topk(top).indices.tolist()
        vocab = logits.shape[-1]
        lookahead, first_steps, step_max = [], [], 0.0
        for token in ids:
            per_rollout = []
            for _ in range(rollouts):
                seq = torch.cat([prefix, torch.tensor([[token]])], 1)
                steps = []
                for _ in range(k):
                    step_logp = torch.log_softmax(model(seq).logits[0, -1].float(), -1)
                    steps.append(float(-(step_logp.exp() * step_logp).sum()))
                    seq = torch.cat([seq, torch.multinomial(step_logp.exp(), 1)[None]], 1)
                per_rollout.append(steps)
                step_max = max(step_max, *steps)
            lookahead.append(rao_blackwell_lookahead(per_rollout))
            first_steps.append(sum(r[0] for r in per_rollout) / rollouts)
    for h, h1 in zip(lookahead, first_steps):
        lo, hi = entropy_bounds(k, vocab)
        assert lo <= h <= hi
        lo1, hi1 = entropy_bounds(k, vocab, first_step=h1)
        assert lo1 <= h <= hi1 + 1e-9
    # restricted to the top candidates (renormalised), draws with bounds after the first step
    cand = [float(logprobs[i]) for i in ids]
    norm = math.log(sum(math.exp(x) for x in cand))
    cand = [x - norm for x in cand]
    rng = random.Random(7)
    alpha, n = 0.5, 6000
    counts, evaluations = [0] * top, 0
    # the per-step ceiling seen on these rollouts (the paper's tighter bounds; admissible here by construction)
    bounds = [entropy_bounds(k, vocab, first_step=h1, step_max=step_max) for h1 in first_steps]
    for _ in range(n):
        perturbed = [x + gumbel(rng) for x in cand]
        result = lazy_argmax(perturbed, [b[0] for b in bounds], [b[1] for b in bounds], alpha,
                             lambda sel: [lookahead[i] for i in sel])
        counts[result.index] += 1
        evaluations += len(result.evaluated)
    expected = tilted_probabilities(cand, lookahead, alpha)
    print(f"lookahead {[round(h, 2) for h in lookahead]}; evaluated {evaluations / n:.2f} of {top} per draw")
    assert chi_square_p(counts, expected) > 1e-3, (counts, expected)
    assert evaluations / n < 0.6 * top, evaluations / n  # exhaustive: all of them, every draw
