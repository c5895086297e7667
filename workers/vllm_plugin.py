"""vLLM general plugin of this package (entry point ``vllm.general_plugins: entropic_pruning``).

vLLM loads general plugins in every process that runs an engine part (front end, engine
core, workers), before attention backends are chosen. Registering over a backend's enum member
is how a third party replaces it:
* CPU_ATTN: ``AttentionBackendEnum.CUSTOM`` is ignored on CPU (vllm 0.32.0
  ``CpuPlatform.get_attn_backend_cls`` always answers CPU_ATTN's class path);
* TRITON_ATTN (GPU): GPU deployments with pruning ask for this backend
  (``deployments.config.EngineConfig.engine_kwargs``); vLLM's other CUDA backends stay as they are.

It also wraps vLLM's CPU GEMM dispatch (``workers.decode_weights``), which changes nothing for an engine whose
``additional_config`` does not ask for bfloat16 decode weights.
"""
from __future__ import annotations

PRUNED_CPU_BACKEND = "workers.pruned_attention.PrunedCPUAttentionBackend"
PRUNED_TRITON_BACKEND = "workers.pruned_attention_gpu.PrunedTritonAttentionBackend"


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, PRUNED_CPU_BACKEND)
    register_backend(AttentionBackendEnum.TRITON_ATTN, PRUNED_TRITON_BACKEND)

    from workers.decode_weights import install

    install()
