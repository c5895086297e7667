"""Routing: the pure ranking law, and Serve polling our replicas' routing stats for the router."""
import time

import httpx

from controller.laws.routing import ReplicaLoad, batch_factor, expected_delay, rank, unit_step_s


def _load(running: int = 0, waiting: int = 0, max_num_seqs: int = 1, step_s: float = 0.0, unit_step_s: float = 0.0,
          remaining: tuple = ()) -> ReplicaLoad:
    return ReplicaLoad(running=running, waiting=waiting, max_num_seqs=max_num_seqs, step_s=step_s,
                       unit_step_s=unit_step_s, remaining=tuple(remaining))


def test_delay_grows_with_load_and_step_time():
    idle = _load(running=0, waiting=0, max_num_seqs=4, unit_step_s=0.1)
    busy = _load(running=4, waiting=3, max_num_seqs=4, unit_step_s=0.1)
    slow = _load(running=4, waiting=3, max_num_seqs=4, unit_step_s=0.3)
    assert expected_delay(idle) == 0.1 * batch_factor(1, 4)  # one step, in a batch of one
    assert expected_delay(idle) < expected_delay(idle, ongoing=2) < expected_delay(busy) < expected_delay(slow)
    assert expected_delay(busy, ongoing=2) == expected_delay(busy)  # the report already covers them


def test_unit_step_time_is_derived_when_a_replica_does_not_report_it():
    # Serve's polled stats from an older replica: step_s measured at a batch of 2 of 4.
    assert unit_step_s(_load(running=2, max_num_seqs=4, step_s=0.15)) == 0.15 / batch_factor(2, 4)
    assert unit_step_s(_load(running=2, max_num_seqs=4, step_s=0.15, unit_step_s=0.07)) == 0.07


def test_the_wait_follows_the_remaining_work_the_controller_knows():
    # A: full, every running sequence far from done. B: full with a longer queue, but its sequences
    # finish within a few steps. Counting requests alone would pick A; B serves a new request first.
    a = _load(running=4, waiting=0, max_num_seqs=4, unit_step_s=0.05, remaining=(400, 450, 500, 512))
    b = _load(running=4, waiting=2, max_num_seqs=4, unit_step_s=0.05, remaining=(3, 5, 8, 9))
    full_step = 0.05 * batch_factor(4, 4)
    assert expected_delay(a) == full_step * 400 + full_step
    assert expected_delay(b) == full_step * 8 + full_step  # its place is the third slot to free
    assert rank([("a", a, 0, 0), ("b", b, 0, 0)]) == ["b", "a"]
    a_counts_only = _load(running=4, waiting=0, max_num_seqs=4, unit_step_s=0.05)
    b_counts_only = _load(running=4, waiting=2, max_num_seqs=4, unit_step_s=0.05)
    assert rank([("a", a_counts_only, 0, 0), ("b", b_counts_only, 0, 0)]) == ["a", "b"]
    # Beyond one wave of slots, each further place costs the mean remaining over the slots.
    assert expected_delay(b, reserved=3) == full_step * (9 + (25 / 4) * 2 / 4) + full_step


def test_speed_and_load_trade_off_among_replicas_with_free_slots():
    def same_speed(running: int, step_s: float = 0.0) -> ReplicaLoad:
        return _load(running=running, max_num_seqs=16, unit_step_s=0.03, step_s=step_s)

    def fast(running: int) -> ReplicaLoad:
        return _load(running=running, max_num_seqs=16, unit_step_s=0.02)

    # Identical replicas: the emptier one, whatever their last steps cost.
    assert rank([("a", same_speed(1, 0.02), 0, 0), ("b", same_speed(0, 0.09), 0, 0)]) == ["b", "a"]
    # A replica 1.5x faster takes a request even with one more sequence, not with twelve more.
    assert rank([("a", fast(1), 0, 0), ("b", same_speed(0), 0, 0)]) == ["a", "b"]
    assert rank([("a", fast(12), 0, 0), ("b", same_speed(0), 0, 0)]) == ["b", "a"]


def test_reservations_split_a_burst_evenly():
    """A burst is routed before any of it is sent or reported: each choice reserves its replica."""
    idle = _load(running=0, waiting=0, max_num_seqs=16, unit_step_s=0.05)
    reserved = {"a": 0, "b": 0}
    for _ in range(6):
        top = rank([(r, idle, 0, reserved[r]) for r in ("a", "b")])[0]
        reserved[top] += 1
    assert reserved == {"a": 3, "b": 3}


def test_rank_puts_replicas_with_no_known_load_last():
    a = _load(running=4, waiting=2, max_num_seqs=4, step_s=0.1)
    b = _load(running=1, waiting=0, max_num_seqs=4, step_s=0.1)
    assert rank([("a", a, 0, 0), ("b", b, 0, 0), ("c", None, 0, 0)]) == ["b", "a", "c"]
    assert rank([("a", a, 0, 0), ("b", b, 9, 0)]) == ["a", "b"]  # what this router has in flight on b counts


def test_stale_loads_are_ignored():
    from controller.messages import RoutingView
    from deployments.routing import _fresh
    from deployments.routing_view import STALE_AFTER_S, ControllerView

    busy = {"at": 100.0, "running": 4, "waiting": 9, "max_num_seqs": 4, "step_s": 0.1, "unit_step_s": 0.05}
    assert _fresh(busy, 100.5) == _load(running=4, waiting=9, max_num_seqs=4, step_s=0.1, unit_step_s=0.05)
    assert _fresh(busy, 100.0 + STALE_AFTER_S + 1) == _load(max_num_seqs=4, step_s=0.1, unit_step_s=0.05)
    assert _fresh({}, 1.0) is None

    view = ControllerView()
    r1 = _load(running=2)
    view.publish(RoutingView(loads={"r1": r1, "r2": _load(running=1)}, ages_s={"r1": 0.5, "r2": STALE_AFTER_S + 0.1}),
                 now=10.0)
    assert view.load("r1", now=10.0) == r1
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
    # The grant is read from the request's positional arguments; GrantedPowerOfTwoRouter extends Serve's default.
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
    from ray.serve.request_router import PendingRequest

    assert {"args", "kwargs", "metadata"} <= set(PendingRequest.__dataclass_fields__)
    assert issubclass(PowerOfTwoChoicesRequestRouter, RequestRouter)
    # Serve pickles the router's module by value: why the shared view lives in deployments.routing_view.
    from ray.serve.config import RequestRouterConfig

    assert "register_pickle_by_value(request_router_module)" in inspect.getsource(RequestRouterConfig)


def test_serve_request_context_we_rename_for_each_choice_is_still_there():
    """deployments/openai_api.py gives each of a request's n choices a Serve call id of its own: handle calls
    take it from the request context (``internal_request_id``), and the router tracks calls by it."""
    import dataclasses
    import inspect

    from ray.serve import context
    from ray.serve._private import default_impl
    from ray.serve._private.utils import generate_request_id

    assert "_internal_request_id" in {f.name for f in dataclasses.fields(context._RequestContext)}
    assert context._serve_request_context.name and callable(context._get_serve_request_context)
    assert "internal_request_id=_request_context._internal_request_id" in inspect.getsource(
        default_impl.get_request_metadata)
    assert generate_request_id() != generate_request_id()
