"""The controller's answers, on the plain controller class (``controller.service``; Serve only hosts it):
π and decode-step grants for a replica's sequences, the routing view, and typed messages that refuse
a misspelt field."""
from __future__ import annotations

import dataclasses
import time

import pytest

from controller.config import MigrationConfig, SchedulingConfig
from controller.messages import ReplicaLoad, SequenceState, SequenceSummary, TelemetryReport
from controller.service import EntropyController


def _controller(**scheduling) -> EntropyController:
    return EntropyController(SchedulingConfig(**scheduling))


def _sequence(expected_drop: float, remaining: float, waited: float = 0.0) -> SequenceState:
    return SequenceState(expected_drop=expected_drop, attended_tokens=200.0, kv_blocks=2.0, waited_s=waited,
                         slo_s=30.0, remaining_tokens=remaining)


def _report(replica: str, **sequences: SequenceState) -> TelemetryReport:
    load = ReplicaLoad(running=len(sequences), waiting=0, max_num_seqs=4, step_s=0.05, unit_step_s=0.04,
                       remaining=tuple(s.remaining_tokens for s in sequences.values()))
    return TelemetryReport(replica_id=replica, node_id="n", sent_at=time.time(), sequences=sequences, summaries={},
                           load=load, routing_stats_polls=0, leases=None, kv_free_tokens=4096, kv_total_tokens=8192,
                           finished={})


def test_the_controller_grants_leases_to_the_highest_priorities_of_each_replica():
    controller = _controller(grant_slots=1, grant_lease_steps=4)
    answer = controller.report(_report("r1", a=_sequence(0.1, 500), b=_sequence(0.8, 20), c=_sequence(0.3, 200)))
    assert max(answer.priorities, key=answer.priorities.__getitem__) == "b"
    assert answer.granted == ("b",)
    other = controller.report(_report("r2", d=_sequence(0.05, 500)))
    assert other.granted == ("d",)  # slots are per replica: each engine runs its own batch
    # Everything is in the debug view, ranked cluster-wide.
    profiles = controller.profiles()
    assert profiles["r1"]["granted"] == ["b"] and profiles["r1"]["ranks"]["b"] == 1
    assert profiles["r2"]["ranks"]["d"] == 4
    assert profiles["r1"]["load"]["running"] == 3


def test_without_grant_slots_the_answer_carries_no_grants():
    answer = _controller().report(_report("r1", a=_sequence(0.1, 10)))
    assert answer.granted is None and set(answer.priorities) == {"a"}


def test_lag_counts_as_waiting():
    controller = _controller()
    fresh = controller.report(_report("r1", a=_sequence(0.1, 10)))
    late = controller.report(dataclasses.replace(_report("r1", a=_sequence(0.1, 10)), sent_at=time.time() - 10))
    assert late.priorities["a"] > fresh.priorities["a"]  # aging: π doubles every aging_s waited


def test_the_routing_view_has_each_live_replicas_load_and_its_age():
    controller = _controller()
    controller.report(_report("r1", a=_sequence(0.1, 10), b=_sequence(0.2, 30)))
    view = controller.routing_view()
    assert view.loads["r1"].running == 2 and view.loads["r1"].max_num_seqs == 4
    assert sorted(view.loads["r1"].remaining) == [10, 30]
    assert 0.0 <= view.ages_s["r1"] < 5.0


def test_messages_refuse_unknown_and_missing_fields():
    with pytest.raises(TypeError):
        ReplicaLoad(running=1, waiting=0, max_num_seqs=4, step_s=0.1, unit_step_s=0.1, remainig=(1,))
    with pytest.raises(TypeError):
        ReplicaLoad(running=1, waiting=0, max_num_seqs=4, step_s=0.1)  # unit_step_s missing
    with pytest.raises(dataclasses.FrozenInstanceError):
        _report("r1").replica_id = "r2"  # type: ignore[misc]


def _summary(prompt_tokens: int = 200) -> SequenceSummary:
    return SequenceSummary(prompt_tokens=prompt_tokens, generated=0, max_tokens=64, expected_drop=None,
                           last_entropy=None, temperature=None, tau=0.0, mean_entropy=0.0, age_s=0.0, idle_s=0.0)


def _waiting_report(replica: str, running: int, unstarted: dict[str, float]) -> TelemetryReport:
    """A replica whose batch (4 slots) runs ``running`` requests and whose queue holds ``unstarted`` (key -> waited)."""
    sequences = {k: _sequence(0.3, 64, waited) for k, waited in unstarted.items()}
    load = ReplicaLoad(running=running, waiting=len(unstarted), max_num_seqs=4, step_s=0.05, unit_step_s=0.04)
    return TelemetryReport(replica_id=replica, node_id="n", sent_at=time.time(), sequences=sequences,
                           summaries={k: _summary() for k in unstarted}, load=load, routing_stats_polls=0, leases=None,
                           kv_free_tokens=4096, kv_total_tokens=8192, finished={}, unstarted=unstarted)


def test_migration_moves_stranded_requests_to_free_slots_once_each():
    controller = EntropyController(SchedulingConfig(), migration=MigrationConfig(enabled=True, after_s=1.0))
    assert controller.report(_waiting_report("idle", 1, {})).moves is None
    answer = controller.report(_waiting_report("full", 4, {"young": 0.2, "a": 2.0, "b": 3.0, "c": 4.0, "d": 5.0}))
    assert answer.moves is not None and set(answer.moves.values()) == {"idle"}
    assert len(answer.moves) == 3 and "young" not in answer.moves  # three free slots there; too young to move
    # Until "idle" reports them, the moved requests hold its slots: nothing more goes there
    again = controller.report(_waiting_report("full", 4, {"young": 2.0, "a": 2.0, "b": 3.0, "c": 4.0, "d": 5.0}))
    assert again.moves is None
    # Once they run there and the slots free again, the one left (and "young", now old enough) may follow;
    # a request never moves twice (max_moves 1), even back where it came from
    moved = set(answer.moves)
    controller.report(dataclasses.replace(_waiting_report("idle", 4, {}), sequences={
        k: _sequence(0.3, 64) for k in moved}))
    controller.report(_waiting_report("idle", 0, {}))
    later = controller.report(_waiting_report("full", 4, {k: 9.0 for k in {"young", "a", "b", "c", "d"}}))
    assert later.moves is not None and set(later.moves) == {"young", "a", "b", "c", "d"} - moved
    metrics = {m.name: m for m in controller.metric_families()}
    assert sum(s.value for s in metrics["entropic_migrations"].samples if s.name.endswith("_total")) == 5


def test_migration_off_moves_nothing():
    answer = EntropyController(SchedulingConfig()).report(_waiting_report("full", 4, {"a": 9.0}))
    assert answer.moves is None
