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

import copy
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from kernels.block_select import select_blocks
from workers.pruning_plan import PrunePlan, PruningPlanner
from workers.pruning_state import STATE


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

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        plan, common = None, common_attn_metadata
        if self._prunable():
            plan, common = self._plan(common_attn_metadata)
        md = super().build(common_prefix_len, common, fast_build)
        if plan is not None and STATE.dense_layers > 0:
            plan.dense = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md.prune = plan
        return md

    def _prunable(self) -> bool:
        spec = self.kv_cache_spec
        return getattr(spec, "sliding_window", None) is None and self.vllm_config.cache_config.cache_dtype == "auto"


class PrunedTritonAttentionImpl(TritonAttentionImpl):
    _summaries: torch.Tensor | None = None  # [KV heads, blocks, 2 * head_size] float32: (max | min) of keys
    _layer_index: int | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        plan = getattr(attn_metadata, "prune", None) if attn_metadata is not None else None
        if plan is None or self.attn_type != AttentionType.DECODER or self._is_per_token_head_quant:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if layer_index(self, layer) < STATE.dense_layers:
            return super().forward(layer, query, key, value, kv_cache, plan.dense, output,
                                   output_scale, output_block_scale)
        metadata = copy.copy(attn_metadata)
        metadata.block_table = compacted_table(self, query, kv_cache, plan)
        return super().forward(layer, query, key, value, kv_cache, metadata, output,
                               output_scale, output_block_scale)


def layer_index(impl: Any, layer: Any) -> int:
    if impl._layer_index is None:
        from workers.pruned_attention import _LAYER_INDEX

        found = _LAYER_INDEX.search(getattr(layer, "layer_name", ""))
        impl._layer_index = int(found.group(1)) if found else 1 << 30
    return impl._layer_index


def compacted_table(impl: Any, query: torch.Tensor, kv_cache: torch.Tensor, plan: PrunePlan) -> torch.Tensor:
    """The plan's block table with each pruned row's kept blocks (this layer's choice) in front.

    ``kv_cache`` is the Triton backend's [blocks, KV heads, block_size, 2 * head_size]: keys are
    the first head_size channels of each token. ``impl`` needs ``head_size``, ``scale`` and a
    ``_summaries`` slot (the layer's impl; a plain namespace in the interpreter test).
    """
    from kernels import block_select_triton

    keys = kv_cache[..., : impl.head_size]  # [blocks, KVH, T, D] view
    blocks, kv_heads = keys.shape[:2]
    if impl._summaries is None or impl._summaries.shape[1] != blocks:
        impl._summaries = torch.zeros(kv_heads, blocks, 2 * impl.head_size, dtype=torch.float32, device=keys.device)
    block_select_triton.summarize_blocks(keys, plan.summarize, impl._summaries)
    q = query.index_select(0, plan.tokens)
    scores = block_select_triton.block_scores(q, plan.physical, plan.num_blocks, impl._summaries, impl.scale,
                                              plan.bias)
    chosen = select_blocks(scores, plan.keep, plan.kmax, plan.beyond)
    # layers run one after another and each kernel reads the table before the next layer writes it
    plan.table[plan.rows, : plan.kmax] = plan.physical.gather(1, chosen).to(plan.table.dtype)
    return plan.table
