"""vLLM general plugin of this package (entry point ``vllm.general_plugins: entropic_pruning``).

vLLM loads general plugins in every process that runs an engine part (front end, engine
core, workers), before attention backends are chosen. Registering over CPU_ATTN is how a
third party replaces the CPU backend: ``AttentionBackendEnum.CUSTOM`` is ignored on CPU
(vllm 0.32.0 ``CpuPlatform.get_attn_backend_cls`` always answers CPU_ATTN's class path).
"""
from __future__ import annotations

PRUNED_CPU_BACKEND = "workers.pruned_attention.PrunedCPUAttentionBackend"


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, PRUNED_CPU_BACKEND)
