"""Entropic KV-block pruning inside vLLM's Triton paged attention (GPU path; written for vllm 0.32.0).

Registered over ``AttentionBackendEnum.TRITON_ATTN`` by the package's plugin
(``workers.vllm_plugin``); GPU deployments with pruning select that backend
(``EngineConfig.engine_kwargs``). Same split as the CPU path (``workers.pruned_attention``):

* Builder (once per step, ``workers.pruning_plan.PruningPlanner``): K per pruned decode row from
  the request's entropy; compacted sequence lengths go into the metadata vLLM's builder makes,
  so the Triton kernel's launch parameters are computed once for all layers.
* Layers: key summaries of newly full blocks (``kernels.block_select_triton.summarize_blocks``),
  block scores (``kernels.block_select_triton.block_scores``), top-K (``torch.topk``), and the
  compacted block table, all on the device; vLLM's ``unified_attention`` kernel then reads only
  the kept blocks. No host sync per layer.

Per-layer block tables cannot live inside one captured CUDA graph, so the builder declares no
CUDA-graph support for attention (vLLM then runs attention eagerly between captured pieces).
Quantized KV caches stay dense (their scale layout is not read here).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from workers.pruning_plan import PrunedLayers, PrunePlan, PruningPlanner


class PrunedTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"  # other vLLM code keys behaviour on this name

    @staticmethod
    def get_impl_cls():
        return PrunedTritonAttentionImpl

    @staticmethod
    def get_builder_cls():
        return PrunedTritonAttentionMetadataBuilder


class PrunedTritonAttentionMetadataBuilder(PruningPlanner, TritonAttentionMetadataBuilder):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def _prunable(self) -> bool:
        spec = self.kv_cache_spec
        return getattr(spec, "sliding_window", None) is None and self.vllm_config.cache_config.cache_dtype == "auto"


class PrunedTritonAttentionImpl(PrunedLayers, TritonAttentionImpl):
    def _prunes(self) -> bool:
        return super()._prunes() and not self._is_per_token_head_quant

    def _compacted_table(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor,
                         plan: PrunePlan) -> torch.Tensor:
        return compacted_table(self, query, kv_cache, plan)


def compacted_table(impl: Any, query: torch.Tensor, kv_cache: torch.Tensor, plan: PrunePlan) -> torch.Tensor:
    """The plan's block table with each pruned row's kept blocks (this layer's choice) in front.

    ``kv_cache`` is the Triton backend's [blocks, KV heads, block_size, 2 * head_size]: keys are
    the first head_size channels of each token. ``impl`` needs ``head_size``, ``scale`` and a
    ``_summaries`` slot (the layer's impl; a plain namespace in the interpreter test).
    """
    from kernels.block_select_triton import compact_table

    keys = kv_cache[..., : impl.head_size]  # [blocks, KVH, T, D] view
    blocks, kv_heads = keys.shape[:2]
    if impl._summaries is None or impl._summaries.shape[1] != blocks or impl._summaries.dtype != keys.dtype:
        # in the cache's dtype: the extremes of bf16 keys are bf16 values, and scoring reads half the bytes
        impl._summaries = torch.zeros(kv_heads, blocks, 2 * impl.head_size, dtype=keys.dtype, device=keys.device)
    # layers run one after another and each kernel reads the table before the next layer writes it
    compact_table(query.index_select(0, plan.tokens), keys, impl._summaries, impl.scale, plan.summarize,
                  plan.physical, plan.num_blocks, plan.bias, plan.keep, plan.table, plan.rows, plan.kmax, plan.beyond)
    return plan.table
