"""π(s) math (pure): monotonicity in each term, bounds (Prop. 2), and the aging bound (Prop. 3)."""
import random

import pytest

from controller.laws.priority import (
    PriorityWeights,
    SequenceState,
    base_priority,
    ewma,
    max_wait_bound,
    priority,
    priority_bounds,
)

W = PriorityWeights()
BASE = SequenceState(expected_drop=0.5, attended_tokens=2048, kv_blocks=32, waited_s=0.0, slo_s=10.0)


def with_(**kw) -> SequenceState:
    return SequenceState(**{**BASE.__dict__, **kw})


def test_each_term_moves_priority_the_right_way():
    p = priority(BASE, W)
    assert priority(with_(expected_drop=1.0), W) > p
    assert priority(with_(attended_tokens=8192), W) < p
    assert priority(with_(kv_blocks=128), W) < p
    assert priority(with_(waited_s=3.0), W) > p


def test_remaining_work_term_ranks_shorter_remaining_work_first_only_when_weighted():
    srpt = PriorityWeights(delta=2.0)
    short, long_ = with_(remaining_tokens=12), with_(remaining_tokens=128)
    assert priority(short, srpt) > priority(long_, srpt)
    assert priority(short, W) == priority(long_, W)  # delta = 0: the paper's π
    lo, hi = priority_bounds(srpt, max_drop=10.0, max_tokens=8192, max_blocks=512, max_remaining=4096)
    assert lo <= base_priority(with_(remaining_tokens=4096, expected_drop=0.0, attended_tokens=8192,
                                     kv_blocks=512, waited_s=0.0), srpt)
    assert max_wait_bound(srpt, 10.0, 8192, 512, 4096) > max_wait_bound(srpt, 10.0, 8192, 512)
    with pytest.raises(ValueError):
        PriorityWeights(delta=-1.0)
    # an unset max_tokens (the context limit) is priced like a long answer, not like 8K tokens of work
    assert priority(with_(remaining_tokens=8000), srpt) == priority(with_(remaining_tokens=512), srpt)


def test_a_resolved_sequence_keeps_a_positive_priority():
    assert priority(with_(expected_drop=0.0), W) > 0


def test_bounded_priority():
    lo, hi = priority_bounds(W, max_drop=10.0, max_tokens=8192, max_blocks=512)
    rng = random.Random(0)
    for _ in range(2000):
        s = SequenceState(rng.uniform(0, 10), rng.uniform(0, 8192), rng.uniform(0, 512), rng.uniform(0, 100),
                          rng.uniform(0.1, 60))
        assert lo <= base_priority(s, W) <= hi


def test_no_starvation_within_the_aging_bound():
    """Simulate a one-slot server: each tick the highest-π sequence runs; fresh high-π work keeps arriving."""
    bound = max_wait_bound(W, max_drop=10.0, max_tokens=8192, max_blocks=512)
    starving = SequenceState(0.0, 8192, 512, 0.0, 1.0)  # worst case: no expected drop, maximal cost
    tick, t = 0.05, 0.0
    while True:
        fresh = SequenceState(10.0, 0.0, 0.0, 0.0, 1e9)  # best case competitor, never waited
        aged = SequenceState(starving.expected_drop, starving.attended_tokens, starving.kv_blocks, t, starving.slo_s)
        if priority(aged, W) >= priority(fresh, W):
            break
        t += tick
        assert t <= bound + tick, f"waited {t:.1f}s beyond the bound {bound:.1f}s"
    assert t > 0 and bound < 300  # a bound that means something at serving time scales


def test_srpt_ranks_by_remaining_work_alone_and_ages_within_its_bound():
    srpt = PriorityWeights(srpt=True)
    short, long_ = with_(remaining_tokens=10), with_(remaining_tokens=400)
    assert priority(short, srpt) > priority(long_, srpt)
    # entropy, context, memory and slack do not move it
    assert priority(with_(remaining_tokens=10, expected_drop=0.0, attended_tokens=8192, kv_blocks=512,
                          slo_s=0.1), srpt) == priority(short, srpt)
    lo, hi = priority_bounds(srpt, max_drop=10.0, max_tokens=8192, max_blocks=512, max_remaining=512)
    assert lo <= base_priority(with_(remaining_tokens=5000), srpt) <= base_priority(with_(remaining_tokens=0), srpt) == hi
    bound = max_wait_bound(srpt, 10.0, 8192, 512, 512)
    waited = with_(remaining_tokens=512, waited_s=bound)
    assert priority(waited, srpt) == pytest.approx(priority(with_(remaining_tokens=0), srpt))  # overtakes at the bound


def test_invalid_weights_rejected():
    with pytest.raises(ValueError):
        PriorityWeights(alpha=0)


def test_ewma():
    assert ewma(None, 2.0, 0.3) == 2.0
    assert ewma(1.0, 2.0, 0.25) == pytest.approx(1.25)
