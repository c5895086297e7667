""""auto" replicas and threads: what the cores Ray gives the application hold (deployments/cpu_plan.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from deployments.config import QUEUED_PER_SLOT, AppConfig
from deployments.cpu_plan import RESERVED_CPUS, NodeResources, plan_replicas
from workers.cpu_cores import available_cpus, engine_threads, threads_per_core

ROOT = Path(__file__).resolve().parents[1]
AUTO = {"num_replicas": None, "num_cpus_per_replica": None, "cpu_threads": None}


@given(cpus=st.integers(1, 256), smt=st.sampled_from([1, 2, 4]))
def test_one_node_runs_one_engine_bound_as_vllm_binds_by_default(cpus, smt):
    # vLLM's CPU worker: one OpenMP thread per physical core of the node, one core reserved for its server
    plan = plan_replicas([NodeResources(float(cpus))], **AUTO, smt=smt)
    assert plan.num_replicas == 1
    assert plan.cpu_threads == max(1, (cpus - RESERVED_CPUS) // smt)
    assert plan.num_cpus_per_replica == max(1, cpus - RESERVED_CPUS)


@given(nodes=st.lists(st.integers(0, 64), min_size=1, max_size=8), replicas=st.none() | st.integers(1, 64),
       smt=st.sampled_from([1, 2]))
def test_the_replicas_a_node_holds_fit_in_its_cpus_less_the_reserved_one(nodes, replicas, smt):
    plan = plan_replicas([NodeResources(float(c)) for c in nodes], **{**AUTO, "num_replicas": replicas}, smt=smt)
    engine_nodes = [c for c in nodes if c >= 1]
    assert plan.num_replicas == (replicas or max(1, len(engine_nodes)))
    assert 1 <= plan.cpu_threads <= plan.num_cpus_per_replica
    if engine_nodes:
        per_node = -(-plan.num_replicas // len(engine_nodes))
        smallest = min(engine_nodes)
        room = smallest - RESERVED_CPUS
        if room >= per_node:  # a CPU for each engine's share: the shares fit, no more
            assert per_node * plan.num_cpus_per_replica <= room
        if room >= per_node * smt:  # a physical core for each engine: its threads fit on their own cores
            assert per_node * plan.cpu_threads * smt <= room


def test_a_head_without_cpus_holds_no_engine_and_gpus_count_by_the_replica_s_share():
    nodes = [NodeResources(0.0), NodeResources(8.0), NodeResources(8.0)]
    assert plan_replicas(nodes, **AUTO) == plan_replicas(nodes[1:], **AUTO)
    assert plan_replicas(nodes, **AUTO).num_replicas == 2
    gpus = [NodeResources(0.0), NodeResources(16.0, 8.0), NodeResources(16.0, 2.0)]
    plan = plan_replicas(gpus, **AUTO, num_gpus_per_replica=2.0)
    assert (plan.num_replicas, plan.num_cpus_per_replica, plan.cpu_threads) == (5, 1.0, 1)


def test_explicit_values_are_kept():
    plan = plan_replicas([NodeResources(32.0)], num_replicas=3, num_cpus_per_replica=0.5, cpu_threads=2)
    assert (plan.num_replicas, plan.num_cpus_per_replica, plan.cpu_threads) == (3, 0.5, 2)
    config = AppConfig.model_validate({"num_replicas": 3, "num_cpus_per_replica": 0.5, "engine": {"cpu_threads": 2}})
    assert config.resolved() is config


def test_autoscaling_plans_one_replica_per_node():
    plan = plan_replicas([NodeResources(16.0)], **AUTO, autoscaling=True)
    assert (plan.num_cpus_per_replica, plan.cpu_threads) == (15.0, 15)


def test_a_resolved_config_is_validated_with_its_replica_count():
    raw = {"dispatch": {"enabled": True}, "max_queued_requests": 128}  # the batch slots of one replica
    config = AppConfig.model_validate(raw)
    assert config.resolved([NodeResources(4.0)]).num_replicas == 1
    with pytest.raises(ValidationError, match="max_queued_requests"):  # two replicas hold 256 slots
        config.resolved([NodeResources(4.0), NodeResources(4.0)])
    resolved = AppConfig.model_validate({}).resolved([NodeResources(0.0), NodeResources(6.0), NodeResources(6.0)])
    assert (resolved.num_replicas, resolved.num_cpus_per_replica, resolved.engine.cpu_threads) == (2, 5.0, 5)
    assert resolved.queue_bound() == QUEUED_PER_SLOT * resolved.engine.max_num_seqs * 2


def test_engine_threads_leave_a_core_and_count_physical_cores():
    assert engine_threads(2, 1) == 1  # this project's 2-core machines: as before, one engine thread
    assert engine_threads(16, 1, smt=2) == 7
    assert engine_threads(32, 2) == 15
    assert engine_threads(1, 4) == 1


def test_available_cpus_follow_the_affinity_the_process_is_given():
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))
    if shutil.which("taskset") is None:
        pytest.skip("taskset is not installed")
    code = "from workers.cpu_cores import available_cpus; print(available_cpus())"
    one = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-c", code],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert one.stdout.strip() == "1"


def test_threads_per_core_match_the_kernel_s_sibling_lists():
    siblings = Path(f"/sys/devices/system/cpu/cpu{min(os.sched_getaffinity(0))}/topology/thread_siblings_list")
    if not siblings.exists():
        pytest.skip("no CPU topology in /sys")
    listed = sum(len(range(int(a), int(b) + 1)) if "-" in part else 1
                 for part in siblings.read_text().strip().split(",") for a, _, b in [part.partition("-")])
    assert threads_per_core() == listed


def test_auto_reads_the_cluster_ray_reports(server, ray_cluster):
    # The session's cluster: a head without CPUs and two worker nodes of one CPU each (tests/conftest.py);
    # this machine alone would give one replica
    _, workers = ray_cluster
    resolved = AppConfig.model_validate({}).resolved()
    assert resolved.num_replicas == len(workers) == 2
    assert (resolved.num_cpus_per_replica, resolved.engine.cpu_threads) == (1.0, 1)
