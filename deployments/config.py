"""Typed configuration of the Serve application, validated when the app is built.

A Serve YAML config passes ``args`` to ``deployments.app:build_app``; those args are an
``AppConfig``: every ``ReplicaConfig`` field (the model, engine, control layers) plus how Serve
runs the replicas. Invalid values fail at start with pydantic's message naming the field.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from controller.config import DispatchConfig, MigrationConfig
from deployments.cpu_plan import NodeResources, current_nodes, plan_replicas
from workers.config import ReplicaConfig
from workers.cpu_cores import threads_per_core

# Serve's queue for the workers, per batch slot, unless max_queued_requests says otherwise. vllm serve and Ray
# Serve queue without bound, and clients send bursts that assume it: `vllm bench serve` sends its 1000 requests
# at once unless told otherwise. Twice the slots, the bound before this, refused most of such a burst, which,
# queued, one replica serves sooner than vllm serve does (docs/results/README.md, the burst rows); 8 per slot
# queues 1024 behind one replica of 128 slots: a bound against a runaway client, not against a burst.
QUEUED_PER_SLOT = 8


class AutoscalingConfig(BaseModel):
    """Serve autoscaling of the worker deployment (replaces ``num_replicas`` when set)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8, gt=0)


class HttpConfig(BaseModel):
    """Who may call the HTTP API, as ``vllm serve``'s --api-key and CORS flags (same defaults)."""

    model_config = ConfigDict(extra="forbid")

    api_keys: list[str] = Field(default_factory=list, description="bearer tokens /v1/* and /debug/* require; "
                                "empty: none, unless the VLLM_API_KEY environment variable names one")
    allowed_origins: list[str] = Field(default_factory=list, description="CORS origins ('*': any)")
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


class AppConfig(ReplicaConfig):
    num_replicas: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto", description='"auto": one per node with CPUs, or per num_gpus_per_replica GPUs '
        "(deployments/cpu_plan.py)")
    autoscaling: AutoscalingConfig | None = None
    max_ongoing_requests: int | None = Field(None, ge=1, description="per worker replica; more wait in Serve's "
                                             "queue. None: twice engine.max_num_seqs, so the batch can fill and as "
                                             "many wait in the engine's own queue")
    token_channel: bool = Field(True, description="worker replicas send a stream's tokens after its first to the "
                                "ingress replica over a TCP connection of its own, a step's tokens in one write, "
                                "instead of each as an item of the Serve call (deployments/token_channel.py)")
    max_queued_requests: int | None = Field(
        None, ge=-1, description="requests waiting in Serve's queue for a worker replica, per ingress replica; "
        "past it, 503 with Retry-After. None: 8 per batch slot (8 x engine.max_num_seqs x replicas, max_replicas "
        "with autoscaling), so a client's burst waits its turn as in vllm serve; -1: unbounded")
    http: HttpConfig = Field(default_factory=HttpConfig)
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM (deployments.server), how long requests "
                                   "in flight may run on while new ones get 503, before Serve shuts down")
    max_request_bytes: int = Field(4 * 2**20, ge=1024, description="largest request body the ingress reads; "
                                   "larger ones get 413")
    request_timeout_s: float | None = Field(
        None, gt=0, description="a generation request's deadline, from its arrival: past it, 408 with an OpenAI error "
        "object if nothing was sent yet, else an in-band error ending the stream, and the engine frees its slot. "
        "None: no deadline, as vllm serve")
    num_cpus_per_replica: Annotated[float, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description='Ray CPUs each worker replica takes; "auto": its node\'s CPUs less one, shared '
        "among the replicas the node holds (1 on GPUs)")
    num_gpus_per_replica: float = Field(0.0, ge=0)
    request_router: Literal["power_of_two", "soonest_served"] = Field(
        "power_of_two", description="Serve's default power-of-two router, or deployments.routing.SoonestServedRouter "
        "(the replica expected to serve a new request soonest, from the controller's view)")
    dispatch: DispatchConfig = Field(default_factory=DispatchConfig)
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    routing_view_period_s: float = Field(
        0.05, gt=0, le=1.5, description="how often the ingress fetches the controller's routing view (soonest_served)")

    @model_validator(mode="after")
    def _serve_queue_holds_the_grants(self) -> AppConfig:
        # Granted requests pass through Serve's queue on their way to the replica; a burst of grants (up to
        # every batch slot at once) must not find it full. "auto" counts as one replica until it is resolved.
        replicas = self.autoscaling.max_replicas if self.autoscaling else self.num_replicas
        slots = self.engine.max_num_seqs * (1 if replicas == "auto" else replicas)
        if self.dispatch.enabled and self.max_queued_requests is not None and 0 <= self.max_queued_requests < slots:
            raise ValueError(f"max_queued_requests ({self.max_queued_requests}) must be at least the batch slots "
                             f"({slots}) with dispatch on, or -1: the controller's queue (dispatch.max_queued) "
                             "bounds what waits")
        return self

    def resolved(self, nodes: list[NodeResources] | None = None) -> AppConfig:
        """This config with every "auto" replaced by the plan for ``nodes`` (default: the Ray cluster this
        process is connected to, or this machine); a config without "auto" comes back as it is."""
        auto = (self.num_replicas, self.num_cpus_per_replica, self.engine.cpu_threads)
        if "auto" not in auto:
            return self
        plan = plan_replicas(
            current_nodes() if nodes is None else nodes,
            num_replicas=None if self.num_replicas == "auto" else self.num_replicas,
            num_cpus_per_replica=None if self.num_cpus_per_replica == "auto" else self.num_cpus_per_replica,
            cpu_threads=None if self.engine.cpu_threads == "auto" else self.engine.cpu_threads,
            num_gpus_per_replica=self.num_gpus_per_replica, autoscaling=self.autoscaling is not None,
            smt=threads_per_core())
        raw = self.model_dump()
        raw.update(num_replicas=plan.num_replicas, num_cpus_per_replica=plan.num_cpus_per_replica)
        raw["engine"]["cpu_threads"] = plan.cpu_threads
        return AppConfig.model_validate(raw)

    def max_replicas(self) -> int:
        """The most worker replicas this (resolved) config runs."""
        replicas = self.autoscaling.max_replicas if self.autoscaling else self.num_replicas
        if replicas == "auto":
            raise ValueError("num_replicas is unresolved: call resolved() first")
        return replicas

    def ongoing_bound(self) -> int:
        """Serve's max_ongoing_requests for the worker deployment (``max_ongoing_requests`` resolved)."""
        return self.max_ongoing_requests if self.max_ongoing_requests is not None else 2 * self.engine.max_num_seqs

    def queue_bound(self) -> int:
        """Serve's max_queued_requests for the worker deployment (``max_queued_requests`` resolved)."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return QUEUED_PER_SLOT * self.engine.max_num_seqs * self.max_replicas()

    def replica(self) -> ReplicaConfig:
        """The part of this config one replica runs with."""
        return ReplicaConfig.model_validate(self.model_dump(include=set(ReplicaConfig.model_fields)))
