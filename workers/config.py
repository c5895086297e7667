"""Typed configuration of one replica: its engine and the entropy control layers around it.

``deployments.config.AppConfig`` extends ``ReplicaConfig`` with what only Ray Serve needs
(replica counts, resources, routing); benchmarks build a ``ReplicaConfig`` directly.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from controller.config import SchedulingConfig
from kernels.hardware import resolve_dtype
from workers.control_params import EpicControl, PruningControl, SamplingControl
from workers.cpu_cores import available_cpus, engine_threads, threads_per_core
from workers.model_store import DEFAULT_MODEL, DEFAULT_MODEL_NAME

CPU_PRUNING_BLOCK_SIZE = 64
# vLLM additional_config key of engine.bf16_decode_weights (workers/decode_weights.py reads it in the engine)
BF16_DECODE_WEIGHTS_KEY = "entropic_bf16_decode_weights"

# EngineArgs a replica cannot honour: the engine runs in the process of the replica's core (no multiprocess engine
# core, docs/design/engine-embedding.md), so there is one worker and no parallel group.
_PARALLEL_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


class EngineConfig(BaseModel):
    """The subset of vLLM's EngineArgs we set, plus anything else in ``extra`` verbatim."""

    model_config = ConfigDict(extra="forbid")

    max_model_len: int = Field(8192, ge=16)
    max_num_seqs: int = Field(128, ge=1, le=1024, description="most requests in one engine step; 128 is vllm serve's "
                              "default on CPUs (its GPU default is 256)")
    max_num_batched_tokens: int | None = Field(None, ge=16)
    enforce_eager: bool = Field(False, description="False: vLLM's compiled mode (torch.compile on CPU, CUDA graphs "
                                "on GPU), as vllm serve runs by default; the first start compiles for minutes and "
                                "later starts reuse vLLM's compile cache. True: eager, starts fast")
    dtype: str = Field("auto", description='"auto": the model\'s dtype, but float32 on CPUs without native bf16')
    block_size: int | None = Field(None, ge=1, description="KV block size; None: vLLM's default, or "
                                   f"{CPU_PRUNING_BLOCK_SIZE} on CPU with pruning enabled")
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_cache_space_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE in GiB (CPU only)")
    cpu_threads: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description='OpenMP threads of each replica\'s engine (CPU only). "auto": one per physical core of '
        "the node's CPUs as Ray counts them (a pod's CPU limit), one CPU left to the serving path, shared among "
        "the replicas the node holds (docs/operations.md, CPU cores)")
    pin_cores: bool = Field(True, description="CPU only: each engine process takes cpu_threads cores of its node "
                            "for itself, never the lowest one, which stays with the serving path "
                            "(workers/cpu_cores.py); False, or too few free cores: the engine floats")
    borrow_serving_cores: bool = Field(True, description="CPU only, where the engine is pinned: the forward pass "
                                       "of a step that schedules at least borrow_min_tokens tokens (a prefill "
                                       "chunk), or attends over at least borrow_min_context tokens where that is "
                                       "set, also runs threads on the cores kept for the serving path, lent to one "
                                       "engine at a time (workers/step_threads.py)")
    borrow_min_tokens: int = Field(128, ge=1, description="the smallest step, in scheduled tokens, that borrows "
                                   "the serving path's cores")
    borrow_min_context: int | None = Field(None, ge=1, description="the smallest step, in tokens of context summed "
                                           "over its sequences (cached and scheduled), that borrows the serving "
                                           "path's cores; None: decode steps never borrow, since the serving path "
                                           "relays their tokens on the core they would borrow "
                                           "(docs/operations.md, CPU cores)")
    cpu_sampler: Literal["inverse_cdf", "vllm"] = Field(
        "inverse_cdf", description="CPU only: how a randomly sampled token is drawn in a step where no request "
        "has a seed of its own, and how penalties are applied. inverse_cdf: one exp per vocabulary token, in one C "
        "call, after min-p/top-k/top-p found without a softmax or a sort of the vocabulary, and "
        "repetition/frequency/presence penalties applied to each row's prompt and output tokens alone "
        "(workers/cpu_sampler.py); vllm: vLLM's paths (a softmax for min-p, a sort for top-p, Gumbel-max with a "
        "random number and two logs per token, penalties over the "
        "whole batch). The same distribution and penalized logits either way, but for exact ties at the top-p "
        "boundary, which inverse_cdf keeps whole, and tokens within float rounding of the min-p cut; seeded steps "
        "always sample with vLLM's path")
    decode_kernel: bool = Field(True, description="CPU only: a step in which every request decodes one token "
                                "(pruned or not) attends with our kernel (kernels/csrc/decode_attention.c: one "
                                "pass over each block read, on the engine's threads) for a bf16 KV cache where the "
                                "CPU has AVX512-BF16 (bf16 dot products), a float32 one where it has AVX2 and FMA; "
                                "False, or elsewhere, and in steps with a prompt chunk: vLLM's CPU attention")
    bf16_decode_weights: Literal["auto"] | Annotated[int, Field(ge=0)] = Field(
        "auto", description="CPU only, float32 engine, where every weight of the model is a bfloat16 value (a "
        "bfloat16 checkpoint widened to float32): linear layers run steps of at most this many rows (decode steps, "
        "and the LM head's rows in every step) over a bfloat16 copy of their weights (kernels/csrc/linear_bf16w.c: "
        "half the bytes, float32 arithmetic; workers/decode_weights.py) and larger steps on vLLM's float32 GEMM, "
        "as before. auto: the rows up to which the kernel built for this CPU (AVX-512 or AVX2) outruns vLLM's GEMM "
        "(kernels.cpu_linear.rows). The copy takes half the float32 weights' memory. 0: vLLM's GEMM in every step")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs", description="which distribution returned logprobs (and the surprisal KV pruning "
        "scores blocks by) are of: processed_logprobs, the one each token was sampled from, after the temperature "
        "law, top-k/top-p and any pruning; raw_logprobs, the model's before any of them (vLLM's default)")
    extra: dict[str, Any] = Field(default_factory=dict, description="more vllm EngineArgs, passed as given")

    @field_validator("extra")
    @classmethod
    def _one_process(cls, extra: dict[str, Any]) -> dict[str, Any]:
        for name in _PARALLEL_ARGS:
            if int(extra.get(name) or 1) > 1:
                raise ValueError(
                    f"engine.extra.{name}={extra[name]}: a replica runs its engine in one process, which rules "
                    "out tensor, pipeline and data parallelism (docs/design/engine-embedding.md); scale with "
                    "num_replicas instead")
        return extra

    def threads(self) -> int:
        """``cpu_threads``, where "auto" is resolved for one engine on this machine. An application resolves
        "auto" itself, for the replicas each node holds (deployments/cpu_plan.py), before any engine starts."""
        if self.cpu_threads != "auto":
            return self.cpu_threads
        return engine_threads(available_cpus(), engines=1, smt=threads_per_core())

    def engine_kwargs(self, model_path: str, served_model_name: str, on_gpu: bool = False,
                      pruning: bool = False) -> dict[str, Any]:
        """vLLM EngineArgs. ``pruning`` on a GPU selects TRITON_ATTN, the backend our pruned path subclasses
        (workers/pruned_attention_gpu.py); ``extra`` can still name another (which then runs dense)."""
        kwargs: dict[str, Any] = dict(
            model=model_path,
            served_model_name=served_model_name,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager,
            dtype=resolve_dtype(self.dtype, on_gpu),
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            logprobs_mode=self.logprobs_mode,
            disable_log_stats=False,
        )
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        elif pruning and not on_gpu:
            # vLLM's CPU default is 128; with pruning, 64 decoded fastest (docs/results/README.md, KV pruning)
            kwargs["block_size"] = CPU_PRUNING_BLOCK_SIZE
        if on_gpu and pruning:
            kwargs["attention_backend"] = "TRITON_ATTN"
        if not on_gpu and self.bf16_decode_weights and kwargs["dtype"] in ("float32", "float"):
            # read by the plugin's wrapper of vLLM's CPU GEMM dispatch; vLLM's compile cache is keyed by it too
            kwargs["additional_config"] = {BF16_DECODE_WEIGHTS_KEY: self.bf16_decode_weights}
        extra = dict(self.extra)
        if "additional_config" in extra and "additional_config" in kwargs:  # a user's entries beside ours
            extra["additional_config"] = {**kwargs["additional_config"], **extra["additional_config"]}
        kwargs.update(extra)
        return kwargs


class ReplicaConfig(BaseModel):
    """One replica: the model, its engine, and the three control layers with their defaults."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL, description='"default" or a local Hugging Face model directory')
    served_model_name: str | None = None
    engine: EngineConfig = Field(default_factory=EngineConfig)
    sampling: SamplingControl = Field(default_factory=SamplingControl)
    pruning: PruningControl = Field(default_factory=PruningControl)
    epic: EpicControl = Field(default_factory=EpicControl)
    pruning_dense_layers: int = Field(0, ge=0, description="first layers that always attend densely (pruned requests too)")
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    telemetry: bool = Field(True, description="per-token entropy telemetry (our logits processor). False: no logits "
                            "processor of ours runs, and the three control layers, which read the entropy, are off")
    telemetry_period_s: float = Field(0.05, gt=0, le=10, description="how often replicas report to the controller")
    engine_stall_timeout_s: float = Field(
        300.0, gt=0, description="the replica fails its health check when one engine step has run this long")
    fault_injection: bool = Field(
        False, description="allow inject_engine_fault (through a Serve handle) to stop an engine loop from inside, "
        "for failure drills")

    def layers_on(self) -> ReplicaConfig:
        """This config as the replica runs it: without telemetry no control layer can run."""
        if self.telemetry:
            return self
        return self.model_copy(update={"sampling": self.sampling.model_copy(update={"enabled": False}),
                                       "pruning": self.pruning.model_copy(update={"enabled": False}),
                                       "epic": self.epic.model_copy(update={"decoding": "sample"}),
                                       "scheduling": self.scheduling.model_copy(update={"enabled": False})})

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return DEFAULT_MODEL_NAME if self.model == DEFAULT_MODEL else self.model.rstrip("/").split("/")[-1]
