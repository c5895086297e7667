"""The remaining-work benchmark's evaluation (loadtest/bench_remaining.py) on reports built by hand: folds
hold out whole prompt groups, and the stop-token ablation removes exactly that feature."""
from __future__ import annotations

import dataclasses
import random

from loadtest.bench_remaining import FOLDS, cross_validate, make_prompts
from tests.test_predictor import _report, _summary


def _reports(n: int) -> tuple[list, dict[str, int]]:
    """Requests whose length shows only in the stop-token mass: it rises as the end nears."""
    rng = random.Random(0)
    reports, groups = [], {}
    for i in range(n):
        key, length = f"k{i}", rng.randint(20, 400)  # within the budget (test_predictor.MAX_TOKENS)
        groups[key] = i % 17
        for generated in (0, 1, 4, 16, 64, 256):
            if generated >= length:
                break
            summary = _summary(100, generated)
            if generated:
                summary = dataclasses.replace(summary, stop_prob=min(1.0, 2.0 / (length - generated)))
            reports.append(_report({key: summary}))
        reports.append(_report({}, finished={key: length}))
    return reports, groups


def test_the_stop_feature_is_what_predicts_here_and_the_ablation_removes_it():
    reports, groups = _reports(200)
    with_stop, no_stop = cross_validate(reports, groups, False), cross_validate(reports, groups, True)
    assert len(with_stop) == len(no_stop) == FOLDS
    for a, b in zip(with_stop, no_stop):
        assert a["budget"] == b["budget"] and a["base"] == b["base"]  # same samples, same folds
        assert a["entropy"] < 0.6 * a["base"]  # with the stop-token mass
        assert b["entropy"] > 0.9 * b["base"]  # without it nothing here tells one request from another


def test_prompts_are_many_and_grouped_by_text():
    prompts = make_prompts(160, 0)
    groups = {}
    for _, prompt, group in prompts:
        assert groups.setdefault(prompt, group) == group
    assert len(groups) >= 25 and {kind for kind, _, _ in prompts} == {"chat", "long_context", "free_form"}
