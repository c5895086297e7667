"""How many engine replicas the cores Ray gives the application hold, and how many threads each runs.

``num_replicas``, ``num_cpus_per_replica`` and ``engine.cpu_threads`` may each be "auto" (the defaults).
They are resolved once, when the application is built, from the nodes Ray reports, so that ``make serve``
uses the machine it runs on without flags:

* replicas: one per node that has CPUs (on GPUs: one per ``num_gpus_per_replica`` GPUs), as ``vllm serve``
  runs one engine per machine; with autoscaling, Serve decides, and each node is planned for one;
* Ray CPUs per replica: the node's CPUs less one left to the serving path (Serve's proxy, the ingress, the
  replicas' event loops), shared among the replicas the node holds, so that Ray places them as planned;
* engine threads: that share, one thread per physical core (``workers.cpu_cores.engine_threads``).

The smallest node with CPUs sets the share: replicas can land on any of them. Hardware threads per core are
counted where the plan is made, which is the engine node under ``make serve`` and the head on KubeRay (the
same machine type, usually; set ``engine.cpu_threads`` where it is not). Explicit values are kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from workers.cpu_cores import engine_threads

RESERVED_CPUS = 1


@dataclass(frozen=True)
class NodeResources:
    """One node as Ray counts it (``ray.nodes()``'s ``Resources``)."""

    cpus: float
    gpus: float = 0.0


@dataclass(frozen=True)
class ReplicaPlan:
    num_replicas: int
    num_cpus_per_replica: float
    cpu_threads: int


def plan_replicas(nodes: list[NodeResources], *, num_replicas: int | None, num_cpus_per_replica: float | None,
                  cpu_threads: int | None, num_gpus_per_replica: float = 0.0, autoscaling: bool = False,
                  smt: int = 1) -> ReplicaPlan:
    """Resolve what is None (the config's "auto") for ``nodes``; the rest is returned as given."""
    on_gpu = num_gpus_per_replica > 0
    engine_nodes = [n for n in nodes if (n.gpus >= num_gpus_per_replica if on_gpu else n.cpus >= 1)]
    if num_replicas is None:
        if on_gpu:
            num_replicas = sum(int(n.gpus // num_gpus_per_replica) for n in engine_nodes)
        else:
            num_replicas = len(engine_nodes)
        num_replicas = max(1, num_replicas)
    per_node = 1 if autoscaling or not engine_nodes else math.ceil(num_replicas / len(engine_nodes))
    node_cpus = min((n.cpus for n in engine_nodes), default=RESERVED_CPUS + 1.0)
    if on_gpu:  # a GPU engine's host threads only feed the GPU: keep Ray's and vLLM's defaults
        share, threads = 1.0, 1
    else:
        share = float(max(1, int(max(0.0, node_cpus - RESERVED_CPUS) // per_node)))
        threads = engine_threads(node_cpus, per_node, smt, RESERVED_CPUS)
    return ReplicaPlan(
        num_replicas=num_replicas,
        num_cpus_per_replica=share if num_cpus_per_replica is None else num_cpus_per_replica,
        cpu_threads=threads if cpu_threads is None else cpu_threads,
    )


def current_nodes() -> list[NodeResources]:
    """The live nodes of the Ray cluster this process is connected to; this machine alone when it is not."""
    import ray

    if not ray.is_initialized():
        from workers.cpu_cores import available_cpus

        return [NodeResources(float(available_cpus()))]
    return [NodeResources(float(n["Resources"].get("CPU", 0.0)), float(n["Resources"].get("GPU", 0.0)))
            for n in ray.nodes() if n.get("Alive")]
