"""The remaining-work predictor (controller/laws/remaining.py) as properties over synthetic requests whose
true remaining work follows a known rule: the fit recovers the rule, predictions stay in the budget, and
entropy features help exactly when the rule uses entropy."""
from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.laws.remaining import WorkSnapshot, _solve, fit, mean_abs_error, predict


def _requests(n: int, seed: int, entropy_matters: bool, stop_matters: bool = False) -> list[tuple[WorkSnapshot, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randint(5, 4000)
        max_tokens = rng.choice([64, 256, 1024])
        generated = rng.randint(0, 40)
        mean_h = rng.uniform(0.2, 3.0) if generated else None
        last_h = rng.uniform(0.0, 4.0) if generated else None
        stop = math.exp(rng.uniform(math.log(1e-4), math.log(0.5))) if generated else None
        log_rest = 2.0 + 0.3 * math.log1p(prompt) + (0.8 * (mean_h or 0.0) if entropy_matters else 0.0)
        if stop_matters and stop is not None:  # the end is near when the stop tokens gather mass
            log_rest -= 0.5 * math.log(1e-4 + stop) + 4.0
        rest = min(max_tokens - generated, math.expm1(log_rest))
        out.append((WorkSnapshot(prompt_tokens=prompt, budget_left=max_tokens - generated, generated=generated,
                                 mean_entropy=mean_h, last_entropy=last_h, expected_drop=None if mean_h is None
                                 else 0.1 * mean_h, stop_prob=stop), rest))
    return out


def test_the_fit_recovers_a_rule_the_budget_does_not_know():
    train, held_out = _requests(400, 0, False), _requests(200, 1, False)
    weights = fit(train, entropy=False)
    assert mean_abs_error(held_out, weights) < 0.25 * mean_abs_error(held_out, None)


def test_entropy_features_help_when_length_depends_on_entropy_and_cost_little_when_not():
    for matters in (True, False):
        train, held_out = _requests(400, 2, matters), _requests(200, 3, matters)
        base = mean_abs_error(held_out, fit(train, entropy=False), entropy=False)
        with_entropy = mean_abs_error(held_out, fit(train, entropy=True), entropy=True)
        if matters:
            assert with_entropy < 0.7 * base  # 0.56 with these seeds: the budget clip is not log-linear
        else:
            assert with_entropy < 1.2 * base + 1.0


def test_the_stop_token_mass_helps_when_the_end_shows_in_it():
    train, held_out = _requests(400, 4, False, stop_matters=True), _requests(200, 5, False, stop_matters=True)
    base = mean_abs_error(held_out, fit(train, entropy=False), entropy=False)
    assert mean_abs_error(held_out, fit(train, entropy=True), entropy=True) < 0.7 * base


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9000), st.floats(0, 5000), st.integers(0, 5000), st.one_of(st.none(), st.floats(0, 10)),
       st.one_of(st.none(), st.floats(0, 1)), st.lists(st.floats(-5, 5), min_size=9, max_size=9))
def test_a_prediction_is_never_negative_nor_beyond_the_budget(prompt, budget, generated, h, stop, weights):
    s = WorkSnapshot(prompt_tokens=prompt, budget_left=budget, generated=generated, mean_entropy=h, last_entropy=h,
                     expected_drop=h, stop_prob=stop)
    assert 0.0 <= predict(weights, s, entropy=True) <= budget
    assert 0.0 <= predict(weights[:4], s, entropy=False) <= budget


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(-3, 3), min_size=4, max_size=4), min_size=4, max_size=4),
       st.lists(st.floats(-3, 3), min_size=4, max_size=4))
def test_the_solver_solves_positive_definite_systems(m, b):
    a = [[sum(m[k][i] * m[k][j] for k in range(4)) + (1.0 if i == j else 0.0) for j in range(4)] for i in range(4)]
    x = _solve(a, b)
    assert all(abs(sum(a[i][j] * x[j] for j in range(4)) - b[i]) < 1e-6 for i in range(4))
