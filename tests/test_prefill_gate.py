"""The prefill gate's law (pure): the share of contended steps that carry prefill, and its credit."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.laws.prefill_gate import PrefillGatePolicy, admit_prefill, full_batch_step_s, prefill_share

times = st.floats(min_value=1e-3, max_value=100.0)


@given(decode=times, prefill=times, target=times)
def test_the_share_holds_the_mean_gap_at_the_target_wherever_it_can(decode, prefill, target):
    policy = PrefillGatePolicy(target_gap_s=target, min_share=1e-6)
    share = prefill_share(policy, decode, prefill)
    assert 0 < share <= 1
    mean_gap = share * prefill + (1 - share) * decode
    if decode < target < prefill and share > policy.min_share:
        assert mean_gap == pytest.approx(target, rel=1e-9)
    else:  # nothing to hold (prefill steps meet it) or nothing deferral could reach (decode steps miss it)
        assert share == 1.0 or share == policy.min_share


@given(decode=times, prefill=times, steps=st.floats(min_value=1.01, max_value=50.0))
def test_a_target_in_decode_steps_holds_the_gap_at_that_many_decode_steps(decode, prefill, steps):
    policy = PrefillGatePolicy(target_decode_steps=steps, min_share=1e-6)
    share = prefill_share(policy, decode, prefill)
    mean_gap = share * prefill + (1 - share) * decode
    if prefill <= steps * decode:  # prefill steps are within the target already: no gate
        assert share == 1.0
    elif share > policy.min_share:
        assert mean_gap == pytest.approx(steps * decode, rel=1e-9)
    # the same share as the target in seconds at this decode step: one law, two ways to say the target
    assert share == prefill_share(PrefillGatePolicy(target_gap_s=steps * decode, min_share=1e-6), decode, prefill)


@given(per_sequence=st.floats(min_value=1e-4, max_value=1.0), now=st.integers(min_value=1, max_value=64),
       more=st.integers(min_value=0, max_value=64), prefill=times)
def test_a_target_in_steps_of_the_whole_batch_lets_more_prefill_through_while_prompts_wait(
        per_sequence, now, more, prefill):
    """Counted in the whole batch's steps, the target never tightens while prompts wait to join the batch."""
    policy = PrefillGatePolicy(target_decode_steps=5, min_share=1e-6)
    decode_now = full_batch_step_s(per_sequence, now)
    alone = prefill_share(policy, decode_now, prefill)
    assert alone == prefill_share(policy, decode_now, prefill, decode_now)  # the default: the step now
    assert prefill_share(policy, decode_now, prefill, full_batch_step_s(per_sequence, now + more)) >= alone


def test_the_whole_batch_step_scales_the_per_sequence_step():
    assert full_batch_step_s(None, 8) is None
    assert full_batch_step_s(0.02, 8) == pytest.approx(0.16)
    assert full_batch_step_s(0.02, 0) == pytest.approx(0.02)  # an empty batch counts one sequence
    # at the start of a wave: 1 sequence decodes in 0.04 s, 7 prompts wait, prefill steps take 10 s
    policy = PrefillGatePolicy(target_decode_steps=5, min_share=0.05)
    assert prefill_share(policy, 0.04, 10.0) == 0.05  # in the step now: (0.2 - 0.04) / 9.96, floored
    assert prefill_share(policy, 0.04, 10.0, full_batch_step_s(0.04, 8)) == pytest.approx((1.6 - 0.04) / 9.96)


def test_no_gate_until_both_kinds_of_step_are_timed_and_a_floor_after():
    policy = PrefillGatePolicy(target_gap_s=0.5, min_share=0.05)
    assert prefill_share(policy, None, 6.0) == prefill_share(policy, 0.2, None) == 1.0
    assert prefill_share(policy, 0.2, 0.4) == 1.0  # a step with prefill is already within the target
    assert prefill_share(policy, 0.6, 6.0) == 1.0  # decode-only steps alone are slower than the target
    assert prefill_share(policy, 0.2, 6.2) == pytest.approx(0.05)  # (0.5 - 0.2) / 6.0
    assert prefill_share(policy, 0.2, 60.0) == 0.05  # the floor: admission never stops


@given(share=st.floats(min_value=0.01, max_value=1.0), steps=st.integers(min_value=1, max_value=500))
def test_the_credit_admits_the_share_of_steps_evenly(share, steps):
    credit, admitted, since, longest = 0.0, 0, 0, 0
    for _ in range(steps):
        allowed, credit = admit_prefill(credit, share)
        assert 0 <= credit < 1
        since += 1
        if allowed:
            admitted += 1
            longest, since = max(longest, since), 0
    assert steps * share - 1 <= admitted <= steps * share + 1e-6
    assert max(longest, since) <= math.ceil(1 / share - 1e-9)  # never more than 1/φ steps between two


def test_an_ungated_step_spends_nothing_and_a_quarter_share_admits_every_fourth():
    credit = 0.0
    for _ in range(10):
        allowed, credit = admit_prefill(credit, 1.0)
        assert allowed and credit == 0.0
    assert [admit_prefill(c, 0.25)[0] for c in (0.0, 0.25, 0.5, 0.75)] == [False, False, False, True]


def test_invalid_policies_are_rejected():
    with pytest.raises(ValueError):
        PrefillGatePolicy(target_gap_s=0)
    with pytest.raises(ValueError):
        PrefillGatePolicy(target_gap_s=1, min_share=0)
    with pytest.raises(ValueError):
        PrefillGatePolicy()  # no target
    with pytest.raises(ValueError):
        PrefillGatePolicy(target_gap_s=1, target_decode_steps=5)  # two
    with pytest.raises(ValueError):
        PrefillGatePolicy(target_decode_steps=1)  # a decode-only step cannot be shorter than itself
