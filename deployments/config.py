"""Typed configuration of the Serve application, validated when the app is built.

A Serve YAML config passes ``args`` to ``deployments.app:build_app``; those args are an
``AppConfig``. Invalid values fail at start with pydantic's message naming the field.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.control_params import PruningControl, SamplingControl
from workers.model_store import DEFAULT_MODEL, DEFAULT_MODEL_NAME


CPU_PRUNING_BLOCK_SIZE = 64


class EngineConfig(BaseModel):
    """The subset of vLLM's EngineArgs we set, plus anything else in ``extra`` verbatim."""

    model_config = ConfigDict(extra="forbid")

    max_model_len: int = Field(8192, ge=16)
    max_num_seqs: int = Field(16, ge=1, le=1024)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    enforce_eager: bool = True
    dtype: str = Field("auto", description='"auto": the model\'s dtype, but float32 on CPUs without native bf16')
    block_size: int | None = Field(None, ge=1, description="KV block size; None: vLLM's default, or 64 on CPU "
                                   "with pruning enabled (the fastest measured)")
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_cache_space_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE in GiB (CPU only)")
    cpu_threads: int = Field(1, ge=1, description="OpenMP threads of each replica's engine (CPU only)")
    extra: dict[str, Any] = Field(default_factory=dict, description="more vllm EngineArgs, passed as given")

    def engine_kwargs(self, model_path: str, served_model_name: str, on_gpu: bool = False,
                      pruning: bool = False) -> dict[str, Any]:
        """vLLM EngineArgs. ``pruning`` on a GPU selects TRITON_ATTN, the backend our pruned path subclasses
        (workers/pruned_attention_gpu.py); ``extra`` can still name another (which then runs dense)."""
        from workers.hardware import resolve_dtype

        kwargs: dict[str, Any] = dict(
            model=model_path,
            served_model_name=served_model_name,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager,
            dtype=resolve_dtype(self.dtype, on_gpu),
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            disable_log_stats=False,
        )
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        elif pruning and not on_gpu:
            # vLLM's CPU default is 128; with pruning, 64 decoded fastest at 2K-7K tokens on the benchmark
            # machine (docs/pruning.md: 1.61x vs 1.43x at ~4K, and faster in absolute tokens/s)
            kwargs["block_size"] = CPU_PRUNING_BLOCK_SIZE
        if on_gpu and pruning:
            kwargs["attention_backend"] = "TRITON_ATTN"
        kwargs.update(self.extra)
        return kwargs


class AutoscalingConfig(BaseModel):
    """Serve autoscaling of the worker deployment (replaces ``num_replicas`` when set)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8, gt=0)


class SchedulingConfig(BaseModel):
    """Entropy-aware scheduling (paper §3.1): π(s) orders admission, batch and preemption."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    alpha: float = Field(1.0, gt=0, description="weight of compute (attended context)")
    beta: float = Field(0.5, gt=0, description="weight of KV memory held")
    gamma: float = Field(1.0, gt=0, description="weight of latency slack")
    aging_s: float = Field(5.0, gt=0, description="a waiting request's π doubles every aging_s seconds")
    slo_s: float = Field(30.0, gt=0, description="end-to-end latency objective behind the slack term")
    delta: float = Field(
        2.0, ge=0, description="weight of remaining work (max_tokens left) in π's cost; 0: the paper's π. Measured "
        "with 2 (docs/benchmarks/scheduling-remaining-work-4rounds.md): mean latency 0.67x, goodput 1.39x FCFS")
    ref_output_tokens: float = Field(128.0, gt=0, description="unit of remaining work")
    remaining_cap_tokens: float = Field(512.0, gt=0, description="remaining work counts at most this many tokens")
    drop_ewma: float = Field(0.2, gt=0, le=1, description="EWMA weight of dH+ in E[dH]")
    prior_drop: float = Field(0.3, ge=0, description="E[dH] (nats/token) assumed before a request's first token")
    preempt_margin: float | None = Field(
        None, ge=1, description="π ratio a waiting request needs to preempt a running one; None: no priority "
        "preemption (vLLM still preempts the lowest π under KV pressure). Measured with 2: TTFT 0.27x but p99 "
        "latency 2.3x FCFS (docs/benchmarks/scheduling-preempt-margin-2.md)")
    controller_timeout_s: float = Field(0.25, gt=0, description="older controller answers fall back to local π")
    grant_slots: int | None = Field(
        None, ge=1, description="decode-step grants: how many sequences per replica get their lease renewed each "
        "control period (highest π first); the others pause, keeping their KV, when their lease runs out. "
        "None: everyone is granted (no pausing)")
    grant_lease_steps: int = Field(8, ge=1, description="decode steps per granted lease")

    def grant_policy(self):
        from controller.laws.grants import GrantPolicy

        return GrantPolicy(slots=self.grant_slots, lease_steps=self.grant_lease_steps)

    def weights(self):
        from controller.laws.priority import PriorityWeights

        return PriorityWeights(alpha=self.alpha, beta=self.beta, gamma=self.gamma, aging_s=self.aging_s,
                               delta=self.delta, ref_output_tokens=self.ref_output_tokens,
                               remaining_cap_tokens=self.remaining_cap_tokens)


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL, description='"default" or a local Hugging Face model directory')
    served_model_name: str | None = None
    num_replicas: int = Field(1, ge=1, le=64)
    autoscaling: AutoscalingConfig | None = None
    max_ongoing_requests: int = Field(64, ge=1, description="per worker replica; more wait in Serve's queue")
    max_queued_requests: int = Field(-1, ge=-1, description="Serve's queue bound per handle; -1: unbounded")
    num_cpus_per_replica: float = Field(1.0, ge=0)
    num_gpus_per_replica: float = Field(0.0, ge=0)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingControl = Field(default_factory=SamplingControl)
    pruning: PruningControl = Field(default_factory=PruningControl)
    pruning_dense_layers: int = Field(0, ge=0, description="first layers that always attend densely (pruned requests too)")
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    request_router: Literal["power_of_two", "soonest_served"] = Field(
        "power_of_two", description="Serve's default power-of-two router, or deployments.routing.SoonestServedRouter "
        "(the replica expected to serve a new request soonest, from the controller's view). Measured on two CPU "
        "replicas (docs/benchmarks/routing-speed-aware.md): soonest_served mean latency 1.13x, goodput 0.79x power_of_two")
    engine_stall_timeout_s: float = Field(
        300.0, gt=0, description="the replica fails its health check when one engine step has run this long")
    fault_injection: bool = Field(
        False, description="allow EntropicWorker.inject_engine_fault (through a Serve handle) to stop an engine "
        "loop from inside, for failure drills")
    telemetry_period_s: float = Field(0.05, gt=0, le=10, description="how often replicas report to the controller")
    routing_view_period_s: float = Field(
        0.05, gt=0, le=1.5, description="how often the ingress fetches the controller's routing view (soonest_served). "
        "Measured: 0.5 s routed worse than 0.05 s (docs/benchmarks/routing-view-0.md vs routing-speed-aware.md)")

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return DEFAULT_MODEL_NAME if self.model == DEFAULT_MODEL else self.model.rstrip("/").split("/")[-1]
