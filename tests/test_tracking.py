"""A replica's per-request profile (pure)."""
from types import SimpleNamespace

import pytest

from workers.tracking import PriorityBoard, SequenceTrack


def delta(entropy, completion_tokens, tau=0.0, stop_prob=None, epic=None):
    return SimpleNamespace(entropy=entropy, temperature=[1.0] * len(entropy), completion_tokens=completion_tokens,
                           entropic_time=tau, mean_entropy=0.0, token_ids=[0] * len(entropy), stop_prob=stop_prob,
                           epic=epic)


def test_the_latest_stop_token_mass_reaches_the_summary():
    track = SequenceTrack(arrival=0.0, last_progress=0.0, prompt_tokens=10, slo_s=30.0)
    assert track.summary(now=0.0).stop_prob is None
    track.observe(delta([1.0], 1, stop_prob=0.02), now=1.0, drop_weight=0.5)
    track.observe(delta([0.5], 2), now=2.0, drop_weight=0.5)  # a delta without a reading keeps the last one
    assert track.summary(now=2.0).stop_prob == 0.02
    track.observe(delta([0.1], 3, stop_prob=0.6), now=3.0, drop_weight=0.5)
    assert track.summary(now=3.0).stop_prob == 0.6


def test_expected_drop_is_an_ewma_of_positive_drops_across_chunks():
    track = SequenceTrack(arrival=0.0, last_progress=0.0, prompt_tokens=10, slo_s=30.0)
    track.observe(delta([3.0, 1.0], 2), now=1.0, drop_weight=0.5)   # drops: 2.0
    assert track.expected_drop == pytest.approx(2.0)
    track.observe(delta([2.0, 0.0], 4), now=2.0, drop_weight=0.5)   # drops: 0.0 (1->2), 2.0
    assert track.expected_drop == pytest.approx(0.5 * (0.5 * 2.0 + 0.0) + 0.5 * 2.0)
    state = track.state(now=5.0, prior_drop=0.3, block_size=16)
    assert state.attended_tokens == 14 and state.kv_blocks == pytest.approx(14 / 16)
    assert state.waited_s == pytest.approx(3.0)


def test_an_epic_requests_rollouts_multiply_its_compute_term():
    from workers.engine import EpicStep

    plain = SequenceTrack(arrival=0.0, last_progress=0.0, prompt_tokens=10, slo_s=30.0)
    epic = SequenceTrack(arrival=0.0, last_progress=0.0, prompt_tokens=10, slo_s=30.0)
    plain.observe(delta([1.0, 1.0], 2), now=1.0, drop_weight=0.5)
    steps = [EpicStep(lookahead_entropy=2.0, candidates_evaluated=2, rollout_tokens=8, exact=True),
             EpicStep(lookahead_entropy=None, candidates_evaluated=0, rollout_tokens=0, exact=True)]
    epic.observe(delta([1.0, 1.0], 2, epic=steps), now=1.0, drop_weight=0.5)
    # 10 engine tokens for 2 output tokens: five times the compute per token over the same context
    assert epic.state(1.0, 0.3, 16).attended_tokens == 5 * plain.state(1.0, 0.3, 16).attended_tokens == 60


def test_prior_before_the_first_drop():
    track = SequenceTrack(arrival=0.0, last_progress=0.0, prompt_tokens=5, slo_s=30.0)
    assert track.state(now=1.0, prior_drop=0.3, block_size=16).expected_drop == 0.3


def test_without_entropy_terms_every_request_gets_the_prior():
    track = SequenceTrack(arrival=0.0, last_progress=0.0, prompt_tokens=5, slo_s=30.0)
    track.observe(delta([3.0, 1.0], 2), now=1.0, drop_weight=0.5)
    assert track.state(now=1.0, prior_drop=0.3, block_size=16).expected_drop == pytest.approx(2.0)
    assert track.state(now=1.0, prior_drop=0.3, block_size=16, entropy_terms=False).expected_drop == 0.3


def test_remaining_work_is_the_output_budget_left():
    track = SequenceTrack(arrival=0.0, last_progress=0.0, prompt_tokens=5, slo_s=30.0, max_tokens=100)
    track.observe(delta([3.0, 1.0, 0.5], 30), now=1.0, drop_weight=0.5)
    assert track.state(now=1.0, prior_drop=0.3, block_size=16).remaining_tokens == 70
    unknown = SequenceTrack(arrival=0.0, last_progress=0.0, prompt_tokens=5, slo_s=30.0)
    assert unknown.state(now=1.0, prior_drop=0.3, block_size=16).remaining_tokens == 0


def test_board_versions():
    board = PriorityBoard()
    assert board.snapshot() == (0, {})
    board.publish({"a": 1.0})
    assert board.snapshot() == (1, {"a": 1.0})
