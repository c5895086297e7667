"""deployments.serve_env: what it sets, that a user's own setting wins, and what Ray makes of it (pinned: a
Ray upgrade that changes what its throughput switch turns on shows here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from deployments import serve_env


def test_apply_sets_what_is_missing_and_keeps_what_the_user_set():
    environ = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "OTHER": "x"}
    in_force = serve_env.apply(environ)
    assert in_force["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert in_force["RAY_SERVE_LOG_TO_STDERR"] == serve_env.SERVE_ENV["RAY_SERVE_LOG_TO_STDERR"]
    assert environ["OTHER"] == "x" and set(serve_env.SERVE_ENV) <= set(environ)
    assert serve_env.THROUGHPUT_SWITCH not in environ  # Ray's throughput mode is the user's to turn on


def _ray_serve_constants(env: dict[str, str]) -> dict:
    names = ["RAY_SERVE_USE_GRPC_BY_DEFAULT", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
             "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "RAY_SERVE_ENABLE_DIRECT_INGRESS", "RAY_SERVE_LOG_TO_STDERR",
             "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"]
    code = ("import json; from ray.serve._private import constants as c; "
            f"print(json.dumps({{n: getattr(c, n) for n in {names!r}}}))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ray_reads_our_environment_as_serve_as_shipped():
    assert _ray_serve_constants(serve_env.SERVE_ENV) == _ray_serve_constants({})


def test_with_rays_throughput_mode_turned_on_our_environment_keeps_its_hops_and_nothing_else():
    shipped = _ray_serve_constants({})
    mode = _ray_serve_constants({serve_env.THROUGHPUT_SWITCH: "1"})
    ours = _ray_serve_constants({**serve_env.SERVE_ENV, serve_env.THROUGHPUT_SWITCH: "1"})
    # the mode's hops: gRPC between replicas, user code on the replica's loop, buffered request logs
    assert ours["RAY_SERVE_USE_GRPC_BY_DEFAULT"] and not shipped["RAY_SERVE_USE_GRPC_BY_DEFAULT"]
    assert not ours["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] and shipped["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"]
    assert ours["RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"] > shipped["RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"]
    # held where Ray ships them, each of which the mode alone would change: handles usable outside an event
    # loop (the server's drain on SIGTERM is such a call: tests/test_own_server.py), no direct ingress, logs on
    # stderr
    for name in serve_env.SERVE_ENV:
        assert ours[name] == shipped[name] != mode[name], name
