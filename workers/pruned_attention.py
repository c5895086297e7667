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
* Attention of a step in which every row decodes one token, pruned or not: our kernel
  (kernels.cpu_decode_attention: bf16 dot products, online softmax, one pass over each block read, the next
  one prefetched, rows and KV heads over the engine's OpenMP threads) for a bf16 cache where the CPU has
  AVX512-BF16, a float32 one where it has AVX2 and FMA (``STATE.decode_kernel``, from
  ``engine.decode_kernel``); else, and for every step with a prompt chunk, vLLM's kernel.
* Key summaries (per-channel min/max per block and KV head, in the cache's dtype) are computed lazily, for full
  blocks only, the first time a pruned row needs them (one C call reading the cache in place,
  kernels.cpu_summary, else the torch path), and dropped when a block's first slot is written
  again (the block pool recycled it). No work is added to cache writes, so
  a deployment that never prunes pays only the builder's row check.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from kernels.block_select import block_scores, select_blocks, summarize_blocks
from kernels.cpu_decode_attention import decode_attention
from kernels.cpu_select import select_into_table
from kernels.cpu_summary import summarize_into
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
        if self.isa not in SUPPORTED_ISAS or is_quantized_kv_cache(self.kv_cache_dtype):
            if not getattr(self, "_warned", False):
                logger.warning("KV pruning off: CPU attention ISA %r with a %s KV cache has a key layout this "
                               "version does not read", self.isa, self.kv_cache_dtype)
                self._warned = True
            return False
        return True


# ISAs whose key-cache block layout key_cache_view reads (checked by tests/test_vllm_pins.py
# against the keys vLLM writes). vLLM picks "amx" for bf16 on CPUs with AMX tiles (Intel Xeons
# since Sapphire Rapids), "vec" otherwise on x86; others stay dense.
SUPPORTED_ISAS = frozenset({"vec", "amx"})
AMX_TOKEN_GROUP = 16  # tokens per AMX B tile: a tile row holds 64 bytes, one 4-byte channel pair per token


def key_cache_view(kv_cache: torch.Tensor, isa: str) -> torch.Tensor:
    """The keys of vLLM's CPU cache (a view, no copy) in a shape ``summarize_blocks`` reads.

    The CPU cache is [blocks, KV heads, block_size, 2 * head_size]; per block and head, the first
    block_size * head_size elements are the keys, the rest the values. The keys' order there is
    the kernel's:

    * "vec": channel-major ([head_size, block_size], so the kernel reads one channel of every token
      contiguously); returned as [blocks, KV heads, tokens, channels].
    * "amx": packed as the B operand of AMX tiles: tokens in groups of 16, and within a group the
      channels in 4-byte pairs, all 16 tokens' pair together ([block_size / 16, head_size / 2, 16, 2]);
      returned as [blocks, KV heads, token groups, 16, channel pairs, 2].
    """
    blocks, kv_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    keys = kv_cache.view(blocks, kv_heads, 2 * block_size * d)[:, :, : block_size * d]
    if isa == "amx":
        pair = 4 // kv_cache.element_size()
        groups = block_size // AMX_TOKEN_GROUP
        return keys.view(blocks, kv_heads, groups, d // pair, AMX_TOKEN_GROUP, pair).transpose(3, 4)
    if isa == "vec":
        return keys.view(blocks, kv_heads, d, block_size).transpose(2, 3)
    raise ValueError(f"no key layout known for CPU attention ISA {isa!r}")


class PrunedCPUAttentionBackendImpl(PrunedLayers, CPUAttentionBackendImpl):
    def _decode(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                output: torch.Tensor) -> bool:
        if (not STATE.decode_kernel or layer.isa != "vec" or metadata.max_query_len != 1
                or metadata.num_actual_tokens != metadata.seq_lens.numel() or self.alibi_slopes is not None
                or self.sinks is not None or self.sliding_window != -1 or self.logits_soft_cap
                or self.kv_cache_dtype != "auto"):
            return False
        if not decode_attention(query, output, kv_cache, metadata.block_table, metadata.seq_lens, self.scale):
            return False
        STATE.stats.decode_kernel_layers += 1
        return True

    def _compacted_table(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor,
                         plan: PrunePlan) -> torch.Tensor:
        isa = layer.isa  # set on each layer by vLLM's builder
        blocks, kv_heads, _, two_d = kv_cache.shape
        # In the cache's dtype: the extremes of bf16 keys are bf16 values, and selection reads half the bytes
        dtype = kv_cache.dtype if kv_cache.dtype in (torch.float32, torch.bfloat16) else torch.float32
        if self._summaries is None or self._summaries.shape[1] != blocks or self._summaries.dtype != dtype:
            self._summaries = torch.zeros(kv_heads, blocks, two_d, dtype=dtype)
        if plan.summarize.numel() and not (
                STATE.fused_selection and summarize_into(kv_cache, isa, plan.summarize, self._summaries)):
            summarize_blocks(key_cache_view(kv_cache, isa), plan.summarize, self._summaries)
        # Layers run one after another and the kernel reads the table before returning, so
        # every layer reuses the plan's scratch table.
        # query: [tokens, heads, head size]
        if STATE.fused_selection and select_into_table(query, plan.tokens, self._summaries, plan.physical, plan.bias,
                                                       plan.keep, self.scale, plan.table, plan.rows):
            return plan.table
        q = query.index_select(0, plan.tokens).view(len(plan.rows), kv_heads, -1, query.shape[-1])
        scores = block_scores(q, self._summaries, plan.physical, self.scale, plan.bias)
        chosen = select_blocks(scores, plan.keep, plan.kmax, plan.beyond)
        plan.table[plan.rows, : plan.kmax] = plan.physical.gather(1, chosen).to(plan.table.dtype)
        return plan.table
