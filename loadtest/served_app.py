"""The served application on this machine, for benchmarks that compare configurations of it.

``ServedApp`` starts Ray (2 CPUs) and Serve's HTTP proxy once; ``measure`` deploys the application
(``deployments.app:build_app``, the code that serves) with fresh replicas for one configuration, warms
it with a few requests, runs a trace against it over HTTP and adds how many requests each worker
replica finished (vLLM's own counter, per replica label).
"""
from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

from loadtest.bench_scheduling import make_trace


async def replay(base: str, jobs: list, one: Callable[..., Coroutine[Any, Any, dict]]) -> tuple[list[dict], float]:
    """Each job sent at its arrival time by ``one(client, model, job, start)`` with the official OpenAI
    client; the rows it returns, and the wall time of the whole trace."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        start = time.monotonic()
        rows = await asyncio.gather(*(one(client, model, j, start) for j in jobs))
        return list(rows), time.monotonic() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_split(base: str) -> dict[str, float]:
    """Requests each worker replica has finished so far."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            found = re.search(r'replica="([^"]+)"', line)
            replica = found.group(1) if found else "?"
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def deploy(config: dict, port: int) -> str:
    import httpx
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(config), name="entropic", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=30).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise RuntimeError("the application never became healthy")
        time.sleep(1)


class ServedApp:
    """Two worker replicas (one engine thread each, ``max_num_seqs`` slots) on this machine's two cores."""

    def __init__(self, max_num_seqs: int) -> None:
        self.base_config = {"num_replicas": 2, "num_cpus_per_replica": 1,
                            "engine": {"max_model_len": 4096, "max_num_seqs": max_num_seqs, "cpu_threads": 1,
                                       "kv_cache_space_gib": 1}}
        self.port = 0

    def __enter__(self) -> ServedApp:
        import ray
        from ray import serve

        self.port = _free_port()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()

    def measure(self, config: dict, trace: Callable[[str], Coroutine[Any, Any, dict]]) -> dict:
        """One run: fresh replicas with ``config`` over the base config, a warm-up, then ``trace(base_url)``."""
        from ray import serve

        from loadtest.bench_routing import run_trace

        serve.delete("entropic")  # no warm state carried across configurations
        base = deploy({**self.base_config, **config}, self.port)
        asyncio.run(run_trace(base, make_trace(4, 100.0, 99)))
        time.sleep(2.0)  # replicas send their metrics to the controller once a second
        before = served_split(base)
        result = asyncio.run(trace(base))
        time.sleep(2.0)
        after = served_split(base)
        result["split"] = sorted(after.get(k, 0.0) - before.get(k, 0.0) for k in after)
        result["base"] = base
        return result
