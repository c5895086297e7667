"""Pure control laws: temperature law (sign corrected), entropic time."""
import math

import pytest

from controller.laws.entropic_time import EntropyTrace, entropic_time, positive_drops
from controller.laws.temperature import PAPER_SIGN, TemperatureLaw, next_temperature, smoothed_entropy


def test_high_entropy_lowers_temperature_and_low_entropy_raises_it():
    law = TemperatureLaw(target_entropy=2.0, eta=0.5, t_min=0.1, t_max=3.0)
    assert next_temperature(1.0, 3.0, law) == pytest.approx(math.exp(-0.5))
    assert next_temperature(1.0, 1.0, law) == pytest.approx(math.exp(0.5))
    assert next_temperature(1.0, 2.0, law) == 1.0


def test_clip_bounds_and_bounded_step():
    law = TemperatureLaw(target_entropy=2.0, eta=1.0, t_min=0.5, t_max=1.5, max_log_step=0.1)
    assert next_temperature(1.0, 12.0, law) == pytest.approx(math.exp(-0.1))
    assert next_temperature(1.0, -8.0, law) == pytest.approx(math.exp(0.1))
    assert next_temperature(0.5, 12.0, law) == 0.5
    assert next_temperature(1.5, 0.0, TemperatureLaw(2.0, 1.0, 0.5, 1.5)) == 1.5


def test_paper_sign_is_the_opposite_feedback():
    corrected = TemperatureLaw(2.0, 0.5, 0.1, 3.0)
    paper = TemperatureLaw(2.0, 0.5, 0.1, 3.0, sign=PAPER_SIGN)
    assert next_temperature(1.0, 3.0, paper) > 1.0 > next_temperature(1.0, 3.0, corrected)


def test_invalid_law_rejected():
    with pytest.raises(ValueError):
        TemperatureLaw(2.0, 0.5, 2.0, 1.0)


def test_ema():
    assert smoothed_entropy(None, 3.0, 0.2) == 3.0
    assert smoothed_entropy(1.0, 3.0, 0.25) == pytest.approx(1.5)
    assert smoothed_entropy(1.0, 3.0, 1.0) == 3.0


def test_entropic_time_counts_only_drops():
    hs = [3.0, 1.0, 2.0, 0.5, 0.5, 4.0, 0.0]
    assert positive_drops(hs) == [0.0, 2.0, 0.0, 1.5, 0.0, 0.0, 4.0]
    assert entropic_time(hs) == pytest.approx(7.5)
    trace = EntropyTrace()
    for h in hs:
        trace.add(h)
    assert trace.tau == pytest.approx(7.5)
    assert trace.tokens == len(hs)
    mean = sum(hs) / len(hs)
    assert trace.mean == pytest.approx(mean)
    assert trace.variance == pytest.approx(sum((h - mean) ** 2 for h in hs) / len(hs))
