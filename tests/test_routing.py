"""Routing: the pure ranking law, and Serve polling our replicas' routing stats for the router."""
import time

import httpx

from controller.laws.routing import expected_delay, rank


def test_expected_delay_grows_with_load_and_step_time():
    idle = {"running": 0, "waiting": 0, "max_num_seqs": 4, "step_s": 0.1}
    busy = {"running": 4, "waiting": 3, "max_num_seqs": 4, "step_s": 0.1}
    slow = {"running": 4, "waiting": 3, "max_num_seqs": 4, "step_s": 0.3}
    assert expected_delay(idle) < expected_delay(busy) < expected_delay(slow)
    assert expected_delay(idle, in_flight=8) > expected_delay(idle)


def test_rank_prefers_the_soonest_and_puts_unknown_last():
    a = {"running": 4, "waiting": 2, "max_num_seqs": 4, "step_s": 0.1}
    b = {"running": 1, "waiting": 0, "max_num_seqs": 4, "step_s": 0.1}
    assert rank([("a", a, 0), ("b", b, 0), ("c", None, 0)]) == ["b", "a", "c"]
    assert rank([("a", a, 0), ("b", b, 9)]) == ["a", "b"]  # what we just sent to b counts until its next report


def test_serve_polls_every_replica_for_routing_stats(server):
    deadline = time.time() + 30
    while time.time() < deadline:
        reports = httpx.get(f"{server}/debug/requests", timeout=10).json()
        if len(reports) == 2 and all(r.get("routing_stats_polls", 0) > 0 for r in reports.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"routing stats were not polled: {reports}")
