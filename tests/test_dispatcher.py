"""The controller's dispatch queue (controller/dispatcher.py) on one event loop: admissions wait for free
slots, go out highest π first, count against their replica until its report shows them, and are shed
when the queue is full or their wait runs out. Reports are built by hand (no engine behind them); the
serving path with real replicas is tests/test_cluster.py."""
from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from controller.config import DispatchConfig, SchedulingConfig
from controller.dispatcher import Dispatcher
from controller.laws.priority import SequenceState
from controller.laws.routing import ReplicaLoad
from controller.messages import Admission, TelemetryReport
from controller.service import EntropyController


def _report(replica: str, running: list[str], capacity: int = 2, kv_free: int = 100_000) -> TelemetryReport:
    state = SequenceState(expected_drop=0.3, attended_tokens=100, kv_blocks=2, waited_s=0, slo_s=30)
    return TelemetryReport(
        replica_id=replica, node_id="n", sent_at=time.time(), sequences=dict.fromkeys(running, state), summaries={},
        load=ReplicaLoad(running=len(running), waiting=0, max_num_seqs=capacity, step_s=0.05, unit_step_s=0.04),
        routing_stats_polls=0, leases=None, kv_free_tokens=kv_free, kv_total_tokens=200_000, finished={})


def _admission(key: str, max_tokens: int = 64, waited: float = 0.0, max_wait: float = 30.0,
               prompt: int = 100) -> Admission:
    return Admission(key=key, prompt_tokens=prompt, max_tokens=max_tokens, waited_s=waited, max_wait_s=max_wait)


def _dispatcher(registry: CollectorRegistry | None = None, **config) -> Dispatcher:
    return Dispatcher(DispatchConfig(enabled=True, **config), SchedulingConfig(), registry or CollectorRegistry())


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_a_request_waits_for_a_free_slot_and_gets_the_replica_that_has_one():
    async def run():
        d = _dispatcher()
        d.observe(_report("r1", ["a", "b"]))
        d.observe(_report("r2", ["c", "d"]))
        waiting = d.enqueue(_admission("new"))
        await asyncio.sleep(0)
        assert not waiting.done()  # both replicas are full
        d.observe(_report("r2", ["c"]))  # one of r2's requests finished
        grant = await asyncio.wait_for(waiting, 1)
        assert grant.replica_id == "r2" and grant.shed is None
    asyncio.run(run())


def test_a_freed_slot_goes_to_the_highest_priority_not_the_first_in_line():
    async def run():
        d = _dispatcher()
        d.observe(_report("r1", ["a", "b"]))
        long_answer = d.enqueue(_admission("long", max_tokens=2000))  # more remaining work: lower π
        short_answer = d.enqueue(_admission("short", max_tokens=16))
        d.observe(_report("r1", ["a"]))
        assert (await asyncio.wait_for(short_answer, 1)).replica_id == "r1"
        assert not long_answer.done()
        d.observe(_report("r1", ["short"]))
        assert (await asyncio.wait_for(long_answer, 1)).replica_id == "r1"
    asyncio.run(run())


def test_an_expensive_epic_request_waits_behind_a_plain_one_of_the_same_size():
    async def run():
        d = _dispatcher()
        d.observe(_report("r1", ["a", "b"]))
        epic = d.enqueue(Admission(key="epic", prompt_tokens=100, max_tokens=64, max_wait_s=30.0, compute_factor=33.0))
        plain = d.enqueue(_admission("plain"))
        d.observe(_report("r1", ["a"]))
        assert (await asyncio.wait_for(plain, 1)).replica_id == "r1"
        assert not epic.done()
        d.observe(_report("r1", ["plain"]))
        assert (await asyncio.wait_for(epic, 1)).replica_id == "r1"
    asyncio.run(run())


def test_a_request_that_waited_longer_elsewhere_keeps_its_place_after_a_restart():
    """A restarted controller's queue is rebuilt from what the ingress resends, with the time each request
    had waited: aging then ranks the one that waited long above an otherwise better newcomer."""
    async def run():
        d = _dispatcher()  # the new controller
        d.observe(_report("r1", ["a", "b"]))
        old = d.enqueue(_admission("old", max_tokens=2000, waited=25.0))
        new = d.enqueue(_admission("new", max_tokens=16))
        d.observe(_report("r1", ["a"]))
        assert (await asyncio.wait_for(old, 1)).replica_id == "r1"
        assert not new.done()
    asyncio.run(run())


def test_a_burst_is_spread_by_free_slots_and_counted_until_the_reports_show_it():
    async def run():
        registry = CollectorRegistry()
        d = _dispatcher(registry)
        d.observe(_report("r1", []))
        d.observe(_report("r2", []))
        futures = [d.enqueue(_admission(f"q{i}")) for i in range(5)]
        await asyncio.sleep(0)
        grants = [f.result() for f in futures if f.done()]
        by_replica = {rid: sum(g.replica_id == rid for g in grants) for rid in ("r1", "r2")}
        assert by_replica == {"r1": 2, "r2": 2} and not futures[4].done()  # 2 slots each: the fifth waits
        # A report that does not show its requests yet changes nothing: they are still in flight.
        d.observe(_report("r1", []))
        await asyncio.sleep(0)
        assert not futures[4].done()
        mine = [g.key for g in grants if g.replica_id == "r1"]
        d.observe(_report("r1", mine[:1]))  # one landed, the other finished already or is still coming
        await asyncio.sleep(0)
        assert not futures[4].done()
        assert _sample(registry, "entropic_dispatch_landed_total", where="granted") == 1
    asyncio.run(run())


def test_the_snapshot_keeps_what_each_granting_decision_saw_and_chose():
    """/debug/dispatch shows, per recent decision that granted something, each replica's inputs as the law
    saw them (in flight included) and the grants in order, so a split can be explained after the fact."""
    async def run():
        d = _dispatcher()
        d.observe(_report("r1", ["a"]))
        d.observe(_report("r2", []))
        first = d.enqueue(_admission("q1"))
        await asyncio.sleep(0)
        second = d.enqueue(_admission("q2"))
        await asyncio.sleep(0)
        assert first.done() and second.done()
        decisions = d.snapshot()["decisions"]
        assert [x["assigned"] for x in decisions] == [[["q1", "r2"]], [["q2", "r1"]]]
        # the second decision counted q1 against r2 (in flight, not yet in a report): both had one then
        assert {r: (s["running"], s["in_flight"]) for r, s in decisions[1]["replicas"].items()} == \
            {"r1": (1, 0), "r2": (0, 1)}
        assert decisions[1]["replicas"]["r1"]["unit_step_s"] == 0.04 and decisions[0]["at_s_ago"] >= 0
        d.observe(_report("r1", ["a"]))  # a decision that grants nothing is not kept
        assert len(d.snapshot()["decisions"]) == 2
    asyncio.run(run())


def test_a_request_seen_on_another_replica_is_counted_as_landed_elsewhere():
    async def run():
        registry = CollectorRegistry()
        d = _dispatcher(registry)
        d.observe(_report("r1", []))
        grant = await asyncio.wait_for(d.enqueue(_admission("x")), 1)
        other = "r2" if grant.replica_id == "r1" else "r1"
        d.observe(_report(other, ["x"]))
        assert _sample(registry, "entropic_dispatch_landed_total", where="elsewhere") == 1
    asyncio.run(run())


def test_a_full_queue_sheds_at_once_and_a_late_request_at_its_deadline():
    async def run():
        registry = CollectorRegistry()
        d = _dispatcher(registry, max_queued=2)
        d.observe(_report("r1", ["a", "b"]))
        first = d.enqueue(_admission("q1", max_wait=0.2))
        d.enqueue(_admission("q2"))
        third = d.enqueue(_admission("q3"))
        assert third.done() and third.result().shed == "queue_full"
        started = time.monotonic()
        # r1 keeps reporting a full batch; the deadline alone decides q1's fate
        grant = await asyncio.wait_for(first, 5)
        assert grant.shed == "deadline" and grant.replica_id is None
        assert 0.2 <= time.monotonic() - started < 2.0
        assert _sample(registry, "entropic_dispatch_shed_total", reason="queue_full") == 1
        assert _sample(registry, "entropic_dispatch_shed_total", reason="deadline") == 1
    asyncio.run(run())


def test_a_withdrawn_request_leaves_the_queue_and_never_takes_a_slot():
    async def run():
        d = _dispatcher()
        d.observe(_report("r1", ["a", "b"]))
        gone = d.enqueue(_admission("gone"))
        stays = d.enqueue(_admission("stays", max_tokens=4000))
        d.withdraw("gone", gone)
        assert gone.cancelled()
        d.observe(_report("r1", ["a"]))
        assert (await asyncio.wait_for(stays, 1)).replica_id == "r1"
        assert d.snapshot()["queue"] == []
    asyncio.run(run())


def test_a_replica_silent_for_longer_than_stale_after_gets_nothing():
    async def run():
        now = [100.0]
        d = Dispatcher(DispatchConfig(enabled=True, stale_after_s=3.0), SchedulingConfig(), CollectorRegistry(),
                       clock=lambda: now[0])
        d.observe(_report("r1", []))
        now[0] += 5.0
        waiting = d.enqueue(_admission("q"))
        await asyncio.sleep(0)
        assert not waiting.done()
        d.observe(_report("r2", []))
        assert (await asyncio.wait_for(waiting, 1)).replica_id == "r2"
    asyncio.run(run())


def test_the_controller_feeds_its_reports_to_the_queue_and_refuses_admissions_with_dispatch_off():
    async def run():
        controller = EntropyController(SchedulingConfig(), DispatchConfig(enabled=True))
        controller.report(_report("r1", ["a", "b"]))
        waiting = controller.enqueue(_admission("q"))
        controller.report(_report("r1", ["a"]))
        assert (await asyncio.wait_for(waiting, 1)).replica_id == "r1"
        with pytest.raises(RuntimeError):
            EntropyController(SchedulingConfig()).enqueue(_admission("q"))
    asyncio.run(run())
