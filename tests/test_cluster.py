"""The application on a multi-node Ray test cluster: placement, telemetry round trip, cluster-wide
ranking, and serving through a controller kill and restart."""
from __future__ import annotations

import concurrent.futures as cf
import re
import time

import httpx
import pytest


def _debug(server) -> dict:
    return httpx.get(f"{server}/debug/requests", timeout=10).json()


def _local_priority_count(server) -> float:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("entropic_priority_count{") and 'source="local"' in line)


def test_engine_replicas_run_on_two_worker_nodes(server, ray_cluster):
    _, workers = ray_cluster
    deadline = time.time() + 30
    while len(reports := _debug(server)) < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert len(reports) == 2, reports.keys()
    nodes = {report["node_id"] for report in reports.values()}
    assert nodes == {w.node_id for w in workers}


def test_cluster_wide_ranking_of_active_sequences(server, client, served_model):
    def one(i: int) -> None:
        client.completions.create(model=served_model, prompt=f"Story {i}:", max_tokens=80, temperature=0,
                                  extra_body={"ignore_eos": True})

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(4)]
        best: dict = {}
        deadline = time.time() + 60
        while time.time() < deadline and not all(f.done() for f in futures):
            reports = _debug(server)
            ranked = {(r, k): rank for r, rep in reports.items() for k, rank in rep.get("ranks", {}).items()}
            if len(ranked) > len(best):
                best = {key: (rank, reports[key[0]]["priorities"][key[1]]) for key, rank in ranked.items()}
            time.sleep(0.05)
        for f in futures:
            f.result(timeout=300)
    assert len({r for r, _ in best}) == 2, "sequences of both replicas should be ranked together"
    ordered = sorted(best.values())
    assert [rank for rank, _ in ordered] == list(range(1, len(ordered) + 1))
    assert all(a[1] >= b[1] for a, b in zip(ordered, ordered[1:]))  # rank 1 has the highest π


@pytest.mark.disruptive
def test_serving_continues_through_a_controller_kill_and_restart(server, client, served_model):
    import ray

    local_before = _local_priority_count(server)
    [entry] = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EntropyController" in a["name"]]
    controller = ray.get_actor(entry["name"], namespace=entry["namespace"])

    def stream(i: int) -> int:
        chunks = client.completions.create(model=served_model, prompt=f"Item {i}:", max_tokens=60, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        return sum(len(c.choices[0].model_extra["entropic"]["entropy"]) for c in chunks if c.choices)

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, i) for i in range(6)]
        time.sleep(1.0)
        ray.kill(controller, no_restart=True)
        tokens = [f.result(timeout=300) for f in futures]
    assert tokens == [60] * 6  # no request lost or cut short

    # Serve starts a new controller replica; telemetry and the merged metrics come back.
    deadline = time.time() + 120
    while time.time() < deadline:
        response = httpx.get(f"{server}/metrics", timeout=10)
        if response.status_code == 200 and len(set(re.findall(r'replica="([^"]+)"', response.text)) - {"controller"}) == 2:
            break
        time.sleep(1)
    else:
        pytest.fail("the merged metrics did not come back after the controller restart")
    assert _local_priority_count(server) > local_before  # replicas fell back to local π meanwhile
    out = client.completions.create(model=served_model, prompt="After the restart,", max_tokens=5)
    assert out.usage.completion_tokens == 5
