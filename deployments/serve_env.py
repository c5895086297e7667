"""The environment Ray Serve's processes start with: Serve's data plane as Ray ships it, with three settings
held where Ray ships them even when the user turns on Ray's throughput mode.

``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` is Ray's own switch (Ray 2.55 and later; docs.ray.io, "Enable High
Throughput on Ray Serve with KubeRay") for a set of settings: deployment handles call replicas over gRPC
instead of through Ray's object store, user code runs on the replica's own event loop instead of a thread
of its own, and request logs are buffered. Every token of a streamed answer crosses two of those hops
(worker replica to ingress, ingress to proxy). It is not our default: in the same rounds, `make serve`
on Serve as shipped gave more output tokens per second than with the switch on (docs/results/, the
serve-stock rows). A user may still turn it on (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1 make serve``).

Three of the switch's other settings are held at Ray's shipped values, so turning it on changes only the
hops above. Its router on the caller's event loop makes a handle unusable outside one: a plain
``handle.method.remote().result()`` raises, as the server's own drain on SIGTERM and any script of a
user's would (``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=1`` keeps Serve's router thread). It turns on
direct ingress (ingress replicas listen for HTTP themselves, and Serve's proxy runs on the head node
only), which is meant to sit behind HAProxy (``RAY_SERVE_ENABLE_HA_PROXY``); without HAProxy the traffic
still comes through the head's proxy, and KubeRay's readiness probe on worker pods asks the proxy that
direct ingress would remove. And it stops Serve's logs going to stderr, where `make serve` shows the
replicas' logs (a few lines per request, not per token).

Ray reads these variables once, when ``ray.serve`` is imported, in every process: the driver, and the
controller, proxies and replicas, which inherit the environment of the process that starts Ray. So
``apply`` runs before either. A variable the user set, to any value, is left as it is.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping

SERVE_ENV: dict[str, str] = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
                             "RAY_SERVE_LOG_TO_STDERR": "1"}
# Ray's switch for its throughput mode: not in SERVE_ENV, so `make serve` runs without it unless the user sets it
THROUGHPUT_SWITCH = "RAY_SERVE_THROUGHPUT_OPTIMIZED"


def apply(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of ``SERVE_ENV`` that ``environ`` lacks; returns the values now in force."""
    for name, value in SERVE_ENV.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in SERVE_ENV}
