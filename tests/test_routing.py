"""Routing: the pure ranking law, and Serve polling our replicas' routing stats for the router."""
import time

import httpx

from controller.laws.routing import expected_wait_s, rank, routing_key


def test_wait_is_zero_while_a_slot_is_free_and_grows_with_load_and_step_time():
    idle = {"running": 0, "waiting": 0, "max_num_seqs": 4, "step_s": 0.1}
    busy = {"running": 4, "waiting": 3, "max_num_seqs": 4, "step_s": 0.1}
    slow = {**busy, "step_s": 0.3}
    assert expected_wait_s(idle, 3) == 0.0
    assert 0.0 < expected_wait_s(busy, 7) < expected_wait_s(slow, 7)
    assert routing_key(idle) < routing_key(idle, ongoing=2) < routing_key(busy)
    assert routing_key(busy, ongoing=2) == routing_key(busy)  # the report already covers them


def test_the_wait_follows_the_remaining_work_the_controller_knows():
    # A: full, every running sequence far from done. B: full with a longer queue, but its sequences
    # finish within a few steps. Counting requests alone would pick A; B serves a new request first.
    a = {"running": 4, "waiting": 0, "max_num_seqs": 4, "step_s": 0.1, "remaining": [400, 450, 500, 512]}
    b = {"running": 4, "waiting": 2, "max_num_seqs": 4, "step_s": 0.1, "remaining": [3, 5, 8, 9]}
    assert expected_wait_s(a, 4) == 0.1 * 400
    assert expected_wait_s(b, 6) == 0.1 * 8  # its place is the third slot to free
    assert rank([("a", a, 0, 0), ("b", b, 0, 0)]) == ["b", "a"]
    a_counts_only = {k: v for k, v in a.items() if k != "remaining"}
    b_counts_only = {k: v for k, v in b.items() if k != "remaining"}
    assert rank([("a", a_counts_only, 0, 0), ("b", b_counts_only, 0, 0)]) == ["a", "b"]
    # Beyond one wave of slots, each further place costs the mean remaining over the slots.
    assert expected_wait_s(b, 9) == 0.1 * (9 + (25 / 4) * 2 / 4)


def test_recent_step_time_does_not_outweigh_load_among_free_replicas():
    # Identical replicas: A's last steps were cheap because its batch was small. It must not take
    # a second request while B is empty.
    a = {"running": 1, "waiting": 0, "max_num_seqs": 16, "step_s": 0.03}
    b = {"running": 0, "waiting": 0, "max_num_seqs": 16, "step_s": 0.09}
    assert rank([("a", a, 0, 0), ("b", b, 0, 0)]) == ["b", "a"]
    assert rank([("a", a, 0, 0), ("b", {**b, "running": 1}, 0, 0)]) == ["a", "b"]  # equal load: faster first


def test_reservations_split_a_burst_evenly():
    """A burst is routed before any of it is sent or reported: each choice reserves its replica."""
    idle = {"running": 0, "waiting": 0, "max_num_seqs": 16, "step_s": 0.05}
    reserved = {"a": 0, "b": 0}
    for _ in range(6):
        top = rank([(r, idle, 0, reserved[r]) for r in ("a", "b")])[0]
        reserved[top] += 1
    assert reserved == {"a": 3, "b": 3}


def test_rank_puts_replicas_with_no_known_load_last():
    a = {"running": 4, "waiting": 2, "max_num_seqs": 4, "step_s": 0.1}
    b = {"running": 1, "waiting": 0, "max_num_seqs": 4, "step_s": 0.1}
    assert rank([("a", a, 0, 0), ("b", b, 0, 0), ("c", None, 0, 0)]) == ["b", "a", "c"]
    assert rank([("a", a, 0, 0), ("b", b, 9, 0)]) == ["a", "b"]  # what this router has in flight on b counts


def test_stale_loads_are_ignored():
    from deployments.routing import _fresh
    from deployments.routing_view import STALE_AFTER_S, ControllerView

    busy = {"at": 100.0, "running": 4, "waiting": 9, "max_num_seqs": 4, "step_s": 0.1}
    assert _fresh(busy, 100.5) == busy
    assert _fresh(busy, 100.0 + STALE_AFTER_S + 1) == {**busy, "running": 0, "waiting": 0, "remaining": []}
    assert _fresh({}, 1.0) is None

    view = ControllerView()
    view.publish({"replicas": {"r1": {"running": 2, "age_s": 0.5}, "r2": {"running": 1, "age_s": STALE_AFTER_S + 0.1}}},
                 now=10.0)
    assert view.load("r1", now=10.0) == {"running": 2, "age_s": 0.5}
    assert view.load("r2", now=10.0) is None  # the controller itself had not heard from r2 for too long
    assert view.load("r1", now=10.0 + STALE_AFTER_S) is None  # the poll itself is too old (controller down)
    assert view.load("r3", now=10.0) is None


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
    # Serve pickles the router's module by value: why the shared view lives in deployments.routing_view.
    from ray.serve.config import RequestRouterConfig

    assert "register_pickle_by_value(request_router_module)" in inspect.getsource(RequestRouterConfig)
