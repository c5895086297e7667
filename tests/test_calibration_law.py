"""controller.laws.calibration: the post-hoc temperature fit of paper §5, on synthetic data with a known answer."""
import math
import random

import pytest

from controller.laws.calibration import fit_temperature


def _samples(true_t: float, n: int = 3000, vocab: int = 12, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        z = [rng.gauss(0.0, 2.0) for _ in range(vocab)]
        weights = [math.exp(v / true_t) for v in z]
        out.append((z, rng.choices(range(vocab), weights=weights)[0]))
    return out


def _nll(samples):
    def nll(t: float) -> float:
        total = 0.0
        for z, y in samples:
            m = max(z) / t
            total += m + math.log(sum(math.exp(v / t - m) for v in z)) - z[y] / t
        return total / len(samples)
    return nll


@pytest.mark.parametrize("true_t", [0.25, 1.0, 4.0])
def test_fit_recovers_the_temperature_the_labels_were_drawn_at(true_t):
    assert fit_temperature(_nll(_samples(true_t))) == pytest.approx(true_t, rel=0.1)


def test_fit_is_the_minimum_of_the_likelihood():
    nll = _nll(_samples(2.0, n=500))
    t = fit_temperature(nll)
    assert nll(t) <= min(nll(t * 0.9), nll(t * 1.1))


def test_fit_stays_in_bounds_and_rejects_bad_bounds():
    nll = _nll(_samples(4.0, n=300))
    assert fit_temperature(nll, t_min=0.5, t_max=2.0) == pytest.approx(2.0, rel=1e-3)
    with pytest.raises(ValueError):
        fit_temperature(nll, t_min=2.0, t_max=1.0)
