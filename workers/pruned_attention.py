"""Entropic KV-block pruning inside vLLM's CPU paged attention (adapter; written for vllm 0.32.0).

Registered over ``AttentionBackendEnum.CPU_ATTN`` by the package's ``vllm.general_plugins``
entry point (``workers.vllm_plugin``); no vLLM file is edited. The platform's own kernel
does the attention: a pruned decode row gets a compacted block table (the kept blocks, in
order, current block last) and the matching shorter sequence length.

* Builder (once per step, ``workers.pruning_plan.PruningPlanner``, shared with the GPU path):
  for each plain decode row whose request enables pruning, the law of ``controller.laws.pruning``
  sets K (blocks kept) from the request's entropy; the compacted sequence lengths give the
  kernel's scheduler metadata once for all layers. Rows that are not plain decode (prefill
  chunks, short contexts) keep the dense table.
* Layers (per step): score the row's blocks with this layer's query, keep the top K, hand the
  kernel the compacted table: one fused C call (kernels.cpu_select) where it builds, else the
  torch path (kernels.block_select), which selects the same blocks. Only *which* blocks varies
  by layer.
* Key summaries (per-channel min/max per block and KV head) are computed lazily, for full
  blocks only, the first time a pruned row needs them, and dropped when a block's first
  slot is written again (the block pool recycled it). No work is added to cache writes, so
  a deployment that never prunes pays only the builder's row check.
"""
from __future__ import annotations

import logging

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from kernels.block_select import block_scores, select_blocks, summarize_blocks
from kernels.cpu_select import select_into_table
from workers.pruning_plan import PrunedLayers, PrunePlan, PruningPlanner
from workers.pruning_state import STATE

logger = logging.getLogger(__name__)


class PrunedCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # other vLLM code keys behaviour on this name

    @staticmethod
    def get_impl_cls():
        return PrunedCPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return PrunedCPUAttentionMetadataBuilder


class PrunedCPUAttentionMetadataBuilder(PruningPlanner, CPUAttentionMetadataBuilder):
    def _prunable(self) -> bool:
        if self.is_cross_attention or self.is_encoder_only_attention or self.window_size != -1:
            return False
        if self.isa not in SUPPORTED_ISAS:
            if not getattr(self, "_warned", False):
                logger.warning("KV pruning off: CPU attention ISA %r has a key layout this version does not read", self.isa)
                self._warned = True
            return False
        return True


# ISAs whose key-cache block layout key_cache_view reads (checked by tests/test_vllm_pins.py
# against the keys vLLM writes). Others (e.g. "amx" for bf16 on AMX CPUs) stay dense.
SUPPORTED_ISAS = frozenset({"vec"})


def key_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """Keys as [blocks, KV heads, tokens, channels] over vLLM's CPU cache (a view, no copy).

    The CPU cache is [blocks, KV heads, block_size, 2 * head_size]; per block and head, the
    first block_size * head_size elements are the keys stored channel-major ([head_size,
    block_size], so the kernel reads one channel of every token contiguously), the rest the values.
    """
    blocks, kv_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    keys = kv_cache.view(blocks, kv_heads, 2 * block_size * d)[:, :, : block_size * d]
    return keys.view(blocks, kv_heads, d, block_size).transpose(2, 3)


class PrunedCPUAttentionBackendImpl(PrunedLayers, CPUAttentionBackendImpl):
    def _compacted_table(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: PrunePlan) -> torch.Tensor:
        key_cache = key_cache_view(kv_cache)
        blocks, kv_heads = key_cache.shape[:2]
        if self._summaries is None or self._summaries.shape[1] != blocks:
            self._summaries = torch.zeros(kv_heads, blocks, 2 * key_cache.shape[-1], dtype=torch.float32)
        summarize_blocks(key_cache, plan.summarize, self._summaries)
        q = query.index_select(0, plan.tokens).view(len(plan.rows), kv_heads, -1, query.shape[-1])
        # Layers run one after another and the kernel reads the table before returning, so
        # every layer reuses the plan's scratch table.
        if STATE.fused_selection and select_into_table(q, self._summaries, plan.physical, plan.bias, plan.keep,
                                                       self.scale, plan.table, plan.rows):
            return plan.table
        scores = block_scores(q, self._summaries, plan.physical, self.scale, plan.bias)
        chosen = select_blocks(scores, plan.keep, plan.kmax, plan.beyond)
        plan.table[plan.rows, : plan.kmax] = plan.physical.gather(1, chosen).to(plan.table.dtype)
        return plan.table
