"""The controller's remaining-work predictor (controller/predictor.py) fed the reports a replica sends:
profiles of running requests, then the requests that ended with their lengths. Reports are built by hand
(the served path with real engines is tests/test_cluster.py); lengths follow a rule the budget cannot know."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from controller.config import SchedulingConfig
from controller.laws.priority import SequenceState
from controller.laws.routing import ReplicaLoad
from controller.messages import SequenceSummary, TelemetryReport
from controller.predictor import RemainingWorkPredictor
from controller.service import EntropyController

MAX_TOKENS = 512


def _length(prompt: int) -> int:  # short prompts get long answers here
    return 200 if prompt < 50 else 20


def _summary(prompt: int, generated: int) -> SequenceSummary:
    seen = generated > 0
    return SequenceSummary(prompt_tokens=prompt, generated=generated, max_tokens=MAX_TOKENS,
                           expected_drop=0.2 if seen else None, last_entropy=1.0 if seen else None,
                           temperature=None, tau=0.0, mean_entropy=1.0 if seen else 0.0, age_s=0.0, idle_s=0.0)


def _report(summaries: dict[str, SequenceSummary], finished: dict[str, int] | None = None) -> TelemetryReport:
    state = SequenceState(expected_drop=0.3, attended_tokens=100, kv_blocks=2, waited_s=0, slo_s=30,
                          remaining_tokens=float(MAX_TOKENS))
    return TelemetryReport(
        replica_id="r1", node_id="n", sent_at=time.time(), sequences=dict.fromkeys(summaries, state),
        summaries=summaries, load=ReplicaLoad(running=len(summaries), waiting=0, max_num_seqs=16, step_s=0.05,
                                              unit_step_s=0.04, remaining=(float(MAX_TOKENS),) * len(summaries)),
        routing_stats_polls=0, leases=None, kv_free_tokens=10_000, kv_total_tokens=100_000, finished=finished or {})


def _serve(observe, n: int, aborted: bool = False) -> None:
    """n requests, one after another, each reported as it runs and then as finished (or just gone)."""
    for i in range(n):
        key, prompt = f"k{i}", 10 + (i * 37) % 200
        length = _length(prompt)
        for generated in (0, 1, 4, 16, 64):
            if generated < length:
                observe(_report({key: _summary(prompt, generated)}))
        observe(_report({}, {} if aborted else {key: length}))


def test_it_learns_lengths_the_budget_does_not_know_and_uses_them_once_they_beat_it():
    predictor = RemainingWorkPredictor(CollectorRegistry())
    _serve(predictor.observe, 20)
    assert predictor.chosen == "budget"  # too few held-out samples yet: the budget, as before
    assert predictor.queued(20, MAX_TOKENS) == MAX_TOKENS
    _serve(predictor.observe, 300)
    stats = predictor.stats()
    assert stats["model"] in ("base", "entropy"), stats
    assert stats["held_out_mae_tokens"][stats["model"]] < 0.5 * stats["held_out_mae_tokens"]["budget"]
    assert predictor.queued(20, MAX_TOKENS) > 4 * predictor.queued(150, MAX_TOKENS)


def test_requests_that_vanish_without_an_end_teach_nothing():
    predictor = RemainingWorkPredictor(CollectorRegistry())
    _serve(predictor.observe, 300, aborted=True)
    assert predictor.stats()["train_samples"] == 0 and predictor.stats()["held_out_samples"] == 0
    assert predictor.chosen == "budget"


def test_the_controller_prices_remaining_work_by_the_prediction():
    controller = EntropyController(SchedulingConfig())
    _serve(controller.report, 300)
    long_one, short_one = _summary(20, 1), _summary(150, 1)
    answer = controller.report(_report({"long": long_one, "short": short_one}))
    # Same state except what remains: the one predicted to finish soon is served first
    assert answer.priorities["short"] > answer.priorities["long"]
    remaining = controller.routing_view().loads["r1"].remaining
    assert sorted(remaining)[0] < 0.5 * MAX_TOKENS
    without = EntropyController(SchedulingConfig(predict_remaining=False))
    _serve(without.report, 300)
    answer = without.report(_report({"long": long_one, "short": short_one}))
    assert answer.priorities["short"] == answer.priorities["long"]
