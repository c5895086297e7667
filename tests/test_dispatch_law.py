"""The late-binding dispatch law (controller/laws/dispatch.py) as properties over random queues and clusters."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controller.laws.dispatch import QueuedRequest, ReplicaSlots, dispatch, free_slots
from controller.laws.routing import ReplicaLoad

NOW = 100.0


@st.composite
def replicas(draw):
    out = {}
    for i in range(draw(st.integers(0, 4))):
        capacity = draw(st.integers(1, 6))
        running = draw(st.integers(0, capacity))
        total = draw(st.integers(256, 8192))
        out[f"r{i}"] = ReplicaSlots(
            load=ReplicaLoad(running=running, waiting=draw(st.integers(0, 2)), max_num_seqs=capacity,
                             step_s=draw(st.floats(0.01, 0.5)), unit_step_s=0.0),
            in_flight=draw(st.integers(0, 2)), kv_free_tokens=draw(st.integers(0, total)), kv_total_tokens=total)
    return out


@st.composite
def queues(draw):
    n = draw(st.integers(0, 12))
    return [QueuedRequest(key=f"q{i}", pi=draw(st.floats(1e-4, 10.0)), arrived_s=draw(st.floats(0.0, NOW)),
                          deadline_s=draw(st.one_of(st.none(), st.floats(NOW - 10, NOW + 10))),
                          kv_tokens=draw(st.integers(1, 9000))) for i in range(n)]


@settings(max_examples=400, deadline=None)
@given(queues(), replicas())
def test_every_request_has_exactly_one_fate(queue, cluster):
    d = dispatch(queue, cluster, NOW)
    fates = [k for k, _ in d.assigned] + [k for k, _ in d.shed] + list(d.waiting)
    assert sorted(fates) == sorted(r.key for r in queue)


@settings(max_examples=400, deadline=None)
@given(queues(), replicas())
def test_shed_exactly_what_is_late_or_too_large(queue, cluster):
    d = dispatch(queue, cluster, NOW)
    largest = max((s.kv_total_tokens for s in cluster.values()), default=0)
    expected = {r.key for r in queue if (r.deadline_s is not None and NOW > r.deadline_s)
                or (cluster and r.kv_tokens > largest)}
    assert {k for k, _ in d.shed} == expected


@settings(max_examples=400, deadline=None)
@given(queues(), replicas())
def test_never_more_than_the_free_slots_or_kv_cache(queue, cluster):
    d = dispatch(queue, cluster, NOW)
    tokens = {r.key: r.kv_tokens for r in queue}
    for rid, slots in cluster.items():
        mine = [k for k, r in d.assigned if r == rid]
        assert len(mine) <= free_slots(slots)
        assert sum(tokens[k] for k in mine) <= slots.kv_free_tokens


@settings(max_examples=400, deadline=None)
@given(queues(), replicas())
def test_work_conserving_and_pi_ordered(queue, cluster):
    """A request waits only when no replica it may use had both a slot and KV cache left after the
    higher-π requests were placed; a lower-π request never takes capacity a waiting one could use."""
    d = dispatch(queue, cluster, NOW)
    by_key = {r.key: r for r in queue}
    order = sorted((r for r in queue if r.key not in {k for k, _ in d.shed}),
                   key=lambda r: (-r.pi, r.arrived_s, r.key))
    placed = {rid: [] for rid in cluster}
    for key, rid in d.assigned:
        placed[rid].append(key)
    held_by = {key: rid for rid, key in d.held.items()}
    for waiting_key in d.waiting:
        w = by_key[waiting_key]
        rank = order.index(w)
        for rid, slots in cluster.items():
            if d.held.get(rid) not in (None, waiting_key) and order.index(by_key[d.held[rid]]) < rank:
                continue  # held for a higher-π request
            before = [k for k in placed[rid] if order.index(by_key[k]) < rank]
            slot_left = free_slots(slots) - len(before) > 0
            kv_left = slots.kv_free_tokens - sum(by_key[k].kv_tokens for k in before) >= w.kv_tokens
            assert not (slot_left and kv_left), (waiting_key, rid)
        assert waiting_key not in held_by or cluster[held_by[waiting_key]].kv_total_tokens >= w.kv_tokens


def _cluster(*free_kv: int, capacity: int = 4, running: int = 0, total: int = 4096) -> dict[str, ReplicaSlots]:
    return {f"r{i}": ReplicaSlots(load=ReplicaLoad(running=running, waiting=0, max_num_seqs=capacity, step_s=0.1,
                                                   unit_step_s=0.05),
                                  kv_free_tokens=kv, kv_total_tokens=total) for i, kv in enumerate(free_kv)}


def _req(key: str, pi: float, kv: int = 100, arrived: float = 0.0) -> QueuedRequest:
    return QueuedRequest(key=key, pi=pi, arrived_s=arrived, deadline_s=None, kv_tokens=kv)


def test_a_burst_is_spread_over_free_slots():
    cluster = _cluster(4096, 4096)
    d = dispatch([_req(f"q{i}", 1.0, arrived=i) for i in range(6)], cluster, NOW)
    per = [sum(1 for _, r in d.assigned if r == rid) for rid in cluster]
    assert sorted(per) == [3, 3] and not d.waiting


def test_the_soonest_served_replica_wins():
    cluster = _cluster(4096, 4096)
    busy = ReplicaSlots(load=ReplicaLoad(running=3, waiting=0, max_num_seqs=4, step_s=0.1, unit_step_s=0.05),
                        kv_free_tokens=4096, kv_total_tokens=4096)
    d = dispatch([_req("a", 1.0)], {"busy": busy, "idle": cluster["r1"]}, NOW)
    assert d.assigned == (("a", "idle"),)


def test_capacity_goes_to_the_highest_pi_first():
    d = dispatch([_req("low", 0.1, arrived=0), _req("high", 5.0, arrived=9)], _cluster(4096, capacity=1), NOW)
    assert d.assigned == (("high", "r0"),) and d.waiting == ("low",)


def test_a_large_prompt_holds_a_replica_until_it_fits():
    """Small requests may overtake a prompt that fits nowhere yet, but not on the replica it holds:
    that one drains until the large prompt fits, then the large prompt goes there."""
    cluster = _cluster(1000, 1200, capacity=8, running=2)
    queue = [_req("large", 5.0, kv=3000)] + [_req(f"s{i}", 1.0, kv=100, arrived=i) for i in range(4)]
    d = dispatch(queue, cluster, NOW)
    assert d.waiting[0] == "large" and d.held == {"r1": "large"}
    assert all(r == "r0" for _, r in d.assigned) and len(d.assigned) == 4
    drained = _cluster(1000, 3500, capacity=8, running=2)
    d = dispatch(queue, drained, NOW)
    assert ("large", "r1") in d.assigned


def test_a_prompt_no_replica_can_hold_is_shed_now():
    d = dispatch([_req("huge", 1.0, kv=10_000)], _cluster(4096, total=4096), NOW)
    assert d.shed == (("huge", "too_large"),) and not d.waiting
