"""Routing: the pure ranking law, and Serve polling our replicas' routing stats for the router."""
import time

import httpx

from controller.laws.routing import expected_delay, rank


def test_expected_delay_grows_with_load_and_step_time():
    idle = {"running": 0, "waiting": 0, "max_num_seqs": 4, "step_s": 0.1}
    busy = {"running": 4, "waiting": 3, "max_num_seqs": 4, "step_s": 0.1}
    slow = {"running": 4, "waiting": 3, "max_num_seqs": 4, "step_s": 0.3}
    assert expected_delay(idle) < expected_delay(busy) < expected_delay(slow)
    assert expected_delay(idle, ongoing=8) > expected_delay(idle)
    assert expected_delay(busy, ongoing=2) == expected_delay(busy)  # the report already covers them


def test_stale_load_reports_are_ignored():
    from deployments.routing import STALE_AFTER_S, _fresh

    busy = {"at": 100.0, "running": 4, "waiting": 9, "max_num_seqs": 4, "step_s": 0.1}
    assert _fresh(busy, 100.5) == busy
    assert _fresh(busy, 100.0 + STALE_AFTER_S + 1) == {**busy, "running": 0, "waiting": 0}
    assert _fresh({}, 1.0) is None


def test_rank_prefers_the_soonest_and_puts_unknown_last():
    a = {"running": 4, "waiting": 2, "max_num_seqs": 4, "step_s": 0.1}
    b = {"running": 1, "waiting": 0, "max_num_seqs": 4, "step_s": 0.1}
    assert rank([("a", a, 0), ("b", b, 0), ("c", None, 0)]) == ["b", "a", "c"]
    assert rank([("a", a, 0), ("b", b, 9)]) == ["a", "b"]  # what this router has in flight on b counts


def test_serve_polls_every_replica_for_routing_stats(server):
    deadline = time.time() + 30
    while time.time() < deadline:
        reports = httpx.get(f"{server}/debug/requests", timeout=10).json()
        if len(reports) == 2 and all(r.get("routing_stats_polls", 0) > 0 for r in reports.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"routing stats were not polled: {reports}")


def test_ray_request_router_api_we_use_is_still_there():
    """RequestRouter is alpha API; deployments/routing.py was written against ray 2.60.0."""
    import importlib
    import inspect

    import ray
    from ray.serve.request_router import RequestRouter, RunningReplica

    assert ray.__version__ == "2.60.0", "re-check deployments/routing.py against this Ray, then update the pin"
    assert list(inspect.signature(RequestRouter.choose_replicas).parameters) == [
        "self", "candidate_replicas", "pending_request"]
    assert list(inspect.signature(RequestRouter.on_send_request).parameters) == ["self", "replica_id"]
    assert list(inspect.signature(RequestRouter.decrement_queue_len_cache).parameters) == ["self", "replica_id"]
    assert "on_send_request(replica.replica_id)" in inspect.getsource(
        importlib.import_module("ray.serve._private.router"))
    assert isinstance(inspect.getattr_static(RunningReplica, "routing_stats"), property)
