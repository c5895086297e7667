"""The controller's answers, on the controller class itself (outside Serve: its methods are plain
Python; Serve only hosts it): π and decode-step grants for a replica's sequences, the routing view."""
from __future__ import annotations

import time

from controller.service import EntropyController


def _controller(**scheduling):
    return EntropyController.func_or_class({"scheduling": scheduling})


def _sequence(expected_drop: float, remaining: float, waited: float = 0.0) -> dict:
    return {"expected_drop": expected_drop, "attended_tokens": 200.0, "kv_blocks": 2.0, "waited_s": waited,
            "slo_s": 30.0, "remaining_tokens": remaining}


def _report(**sequences) -> dict:
    return {"sent_at": time.time(), "sequences": sequences, "running": len(sequences), "waiting": 0,
            "max_num_seqs": 4, "step_s": 0.05, "remaining": [s["remaining_tokens"] for s in sequences.values()]}


def test_the_controller_grants_leases_to_the_highest_priorities_of_each_replica():
    controller = _controller(grant_slots=1, grant_lease_steps=4)
    answer = controller.report("r1", _report(a=_sequence(0.1, 500), b=_sequence(0.8, 20), c=_sequence(0.3, 200)))
    assert max(answer["priorities"], key=answer["priorities"].get) == "b"
    assert answer["granted"] == ["b"]
    other = controller.report("r2", _report(d=_sequence(0.05, 500)))
    assert other["granted"] == ["d"]  # slots are per replica: each engine runs its own batch
    # Everything is in the debug view, ranked cluster-wide.
    profiles = controller.profiles()
    assert profiles["r1"]["granted"] == ["b"] and profiles["r1"]["ranks"]["b"] == 1
    assert profiles["r2"]["ranks"]["d"] == 4


def test_without_grant_slots_the_answer_carries_no_grants():
    answer = _controller().report("r1", _report(a=_sequence(0.1, 10)))
    assert set(answer) == {"priorities"}


def test_the_routing_view_has_each_live_replicas_load_and_its_age():
    controller = _controller()
    controller.report("r1", _report(a=_sequence(0.1, 10), b=_sequence(0.2, 30)))
    view = controller.routing_view()["replicas"]
    assert view["r1"]["running"] == 2 and view["r1"]["max_num_seqs"] == 4
    assert sorted(view["r1"]["remaining"]) == [10, 30]
    assert 0.0 <= view["r1"]["age_s"] < 5.0
