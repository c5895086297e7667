"""Migration on the served application: a request stuck behind a long generation on one replica moves,
unstarted, to a replica that has emptied (controller/laws/migration.py, controller/migrator.py, the replica
handing it back, the ingress resending it through the router's grant).

An application of its own next to the session's (which dispatches through the controller's queue, where
nothing waits on a replica): two replicas with one batch slot each, Serve's power-of-two router, and at most
three requests on a replica at once, so where a burst lands is fixed: with one long generation running on
replica A, a burst of five short requests puts three on B and two in A's queue behind the long one.
Its streams go through Serve's handle alone (``token_channel: false``).
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx
import pytest

from tests.conftest import TEST_APP_CONFIG

LONG_TOKENS = 300
SHORT_TOKENS = 8
CONFIG = {
    "num_replicas": 2,
    "num_cpus_per_replica": 0,  # the session's application holds the worker nodes' CPUs
    "engine": {**TEST_APP_CONFIG["engine"], "max_model_len": 2048, "max_num_seqs": 1},
    "telemetry_period_s": 0.05,
    "max_ongoing_requests": 3,
    "migration": {"enabled": True, "after_s": 0.5},
    # every token through Serve's handle, as before the token channel: the session's app streams over the
    # channel (its default), so this keeps the handle-only path running on a real Serve app too
    "token_channel": False,
}


@pytest.fixture(scope="module")
def app(server):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(CONFIG), name="migration", route_prefix="/migration")
    base = f"{server}/migration"
    try:
        deadline = time.time() + 180
        while httpx.get(f"{base}/health", timeout=30).status_code != 200:
            assert time.time() < deadline, "the migration app never became healthy"
            time.sleep(1)
        # both replicas report to the controller before the test relies on their telemetry
        while len(httpx.get(f"{base}/debug/requests", timeout=10).json()) < 2:
            assert time.time() < deadline, "the replicas never reported"
            time.sleep(0.5)
        yield base
    finally:
        serve.delete("migration")


def _sum(base: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(w in line for w in wanted))


def test_requests_stuck_behind_a_long_generation_move_to_the_replica_that_emptied(app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key="unused", timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    moved_before = _sum(app, "entropic_requests_ended_early_total", reason="moved")
    decided_before = _sum(app, "entropic_migrations_total", replica="controller")
    finished: dict[str, float] = {}
    started = threading.Event()

    def long() -> int:
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=LONG_TOKENS,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        tokens = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text and not started.is_set():
                finished["long started"] = time.monotonic()
                started.set()
            tokens += sum(len(c.model_extra["entropic"]["entropy"]) for c in chunk.choices)
        finished["long"] = time.monotonic()
        return tokens

    def short(i: int) -> int:
        out = client.completions.create(model=model, prompt=f"Item {i}:", max_tokens=SHORT_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        finished[f"short-{i}"] = time.monotonic()
        return out.usage.completion_tokens

    with cf.ThreadPoolExecutor(6) as pool:
        running = pool.submit(long)
        assert started.wait(120), "the long generation never started"
        shorts = [pool.submit(short, i) for i in range(5)]
        assert [f.result(timeout=300) for f in shorts] == [SHORT_TOKENS] * 5
        assert running.result(timeout=600) == LONG_TOKENS
    print({k: round(t - finished["long started"], 1) for k, t in finished.items()})
    # Without migration two of them would have waited for the long generation to end
    assert all(t < finished["long"] for k, t in finished.items() if k.startswith("short")), finished
    # exactly those two moved: the replica's count of requests it handed back, and the controller's decisions
    deadline = time.time() + 10  # replicas send their metrics about once a second
    while _sum(app, "entropic_requests_ended_early_total", reason="moved") - moved_before < 2:
        assert time.time() < deadline, "the replicas never counted the moved requests"
        time.sleep(0.5)
    time.sleep(2)
    assert _sum(app, "entropic_requests_ended_early_total", reason="moved") - moved_before == 2
    assert _sum(app, "entropic_migrations_total", replica="controller") - decided_before == 2
