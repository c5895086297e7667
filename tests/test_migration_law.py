"""The migration law (controller/laws/migration.py) as properties over random clusters and stranded requests."""
from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.laws.dispatch import ReplicaSlots, free_slots
from controller.laws.migration import MigrationPolicy, Stranded, migrations
from controller.laws.routing import ReplicaLoad, expected_delay


def _slots(running: int, waiting: int, capacity: int = 4, kv_free: int = 4096, step_s: float = 0.1) -> ReplicaSlots:
    return ReplicaSlots(load=ReplicaLoad(running=running, waiting=waiting, max_num_seqs=capacity, step_s=step_s,
                                         unit_step_s=0.0),
                        kv_free_tokens=kv_free, kv_total_tokens=8192)


@st.composite
def clusters(draw):
    out = {}
    for i in range(draw(st.integers(1, 4))):
        capacity = draw(st.integers(1, 6))
        total = draw(st.integers(256, 8192))
        out[f"r{i}"] = ReplicaSlots(
            load=ReplicaLoad(running=draw(st.integers(0, capacity)), waiting=draw(st.integers(0, 6)),
                             max_num_seqs=capacity, step_s=draw(st.floats(0.01, 0.5)), unit_step_s=0.0),
            in_flight=draw(st.integers(0, 2)), kv_free_tokens=draw(st.integers(0, total)), kv_total_tokens=total)
    return out


@st.composite
def stranded(draw, cluster):
    ids = sorted(cluster) + ["gone"]  # "gone": a replica the controller no longer hears from
    return [Stranded(key=f"s{i}", replica_id=draw(st.sampled_from(ids)), waited_s=draw(st.floats(0.0, 10.0)),
                     pi=draw(st.floats(1e-4, 10.0)), kv_tokens=draw(st.integers(1, 4096)),
                     moves=draw(st.integers(0, 2))) for i in range(draw(st.integers(0, 10)))]


@st.composite
def cases(draw):
    cluster = draw(clusters())
    return cluster, draw(stranded(cluster)), MigrationPolicy(after_s=draw(st.floats(0.0, 5.0)),
                                                               min_gain_s=draw(st.floats(0.0, 1.0)),
                                                               max_moves=draw(st.integers(0, 2)))


@settings(max_examples=400, deadline=None)
@given(cases())
def test_moves_respect_eligibility_and_capacity(case):
    cluster, waiting, policy = case
    moves = migrations(waiting, cluster, policy)
    by_key = {s.key: s for s in waiting}
    assert len({k for k, _ in moves}) == len(moves)  # each request moves at most once per decision
    sources = {s.replica_id for s in waiting if s.waited_s >= policy.after_s and s.moves < policy.max_moves}
    per_target = collections.Counter(t for _, t in moves)
    kv = collections.Counter()
    for key, target in moves:
        s = by_key[key]
        assert s.waited_s >= policy.after_s and s.moves < policy.max_moves
        assert s.replica_id in cluster and target in cluster
        assert target != s.replica_id and target not in sources
        kv[target] += s.kv_tokens
    for target, n in per_target.items():
        assert n <= free_slots(cluster[target])
        assert kv[target] <= cluster[target].kv_free_tokens


@settings(max_examples=300, deadline=None)
@given(clusters(), st.lists(st.floats(1e-4, 10.0), max_size=10), st.integers(1, 2048))
def test_highest_pi_moves_first(cluster, pis, kv_tokens):
    """From one replica, with prompts alike, the requests moved are the highest-π ones: each later
    candidate finds the targets fuller and its own replica emptier than the one before it did."""
    source = sorted(cluster)[0]
    waiting = [Stranded(key=f"s{i}", replica_id=source, waited_s=2.0, pi=pi, kv_tokens=kv_tokens)
               for i, pi in enumerate(pis)]
    moved = {k for k, _ in migrations(waiting, cluster, MigrationPolicy(after_s=1.0))}
    if moved:
        lowest_moved = min(s.pi for s in waiting if s.key in moved)
        assert all(s.pi <= lowest_moved for s in waiting if s.key not in moved)


def test_a_request_moves_from_a_full_replica_to_an_empty_one():
    cluster = {"full": _slots(running=4, waiting=3), "empty": _slots(running=0, waiting=0)}
    waiting = [Stranded(key=f"w{i}", replica_id="full", waited_s=3.0, pi=float(i), kv_tokens=300) for i in range(3)]
    moves = migrations(waiting, cluster, MigrationPolicy(after_s=1.0))
    # highest π first; every waiting one fits the empty replica's four slots
    assert moves == (("w2", "empty"), ("w1", "empty"), ("w0", "empty"))


def test_nothing_moves_too_early_or_too_often_or_for_too_little():
    cluster = {"full": _slots(running=4, waiting=1), "empty": _slots(running=0, waiting=0)}
    young = Stranded(key="young", replica_id="full", waited_s=0.5, pi=1.0, kv_tokens=10)
    assert migrations([young], cluster, MigrationPolicy(after_s=1.0)) == ()
    moved = Stranded(key="moved", replica_id="full", waited_s=5.0, pi=1.0, kv_tokens=10, moves=1)
    assert migrations([moved], cluster, MigrationPolicy(after_s=1.0, max_moves=1)) == ()
    ready = Stranded(key="ready", replica_id="full", waited_s=5.0, pi=1.0, kv_tokens=10)
    gain = expected_delay(cluster["full"].load) - expected_delay(cluster["empty"].load)
    assert migrations([ready], cluster, MigrationPolicy(after_s=1.0, min_gain_s=gain * 1.01)) == ()
    assert migrations([ready], cluster, MigrationPolicy(after_s=1.0, min_gain_s=gain * 0.99)) == (("ready", "empty"),)


def test_no_move_without_room_for_the_prompt_or_a_slot():
    cluster = {"full": _slots(running=4, waiting=2), "small": _slots(running=0, waiting=0, kv_free=100),
               "busy": _slots(running=4, waiting=0)}
    big = Stranded(key="big", replica_id="full", waited_s=5.0, pi=1.0, kv_tokens=500)
    assert migrations([big], cluster, MigrationPolicy(after_s=0.0)) == ()


def test_a_burst_is_spread_over_the_free_slots():
    cluster = {"full": _slots(running=4, waiting=6), "a": _slots(running=2, waiting=0), "b": _slots(running=3, waiting=0)}
    waiting = [Stranded(key=f"w{i}", replica_id="full", waited_s=2.0, pi=1.0, kv_tokens=10) for i in range(6)]
    moves = migrations(waiting, cluster, MigrationPolicy(after_s=1.0))
    assert collections.Counter(t for _, t in moves) == {"a": 2, "b": 1}  # the free slots there, no more
