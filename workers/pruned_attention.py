"""Entropic KV-block pruning inside vLLM's CPU paged attention (adapter; written for vllm 0.32.0).

Registered over ``AttentionBackendEnum.CPU_ATTN`` by the package's ``vllm.general_plugins``
entry point (``workers.vllm_plugin``); no vLLM file is edited. The platform's own kernel
does the attention: a pruned decode row gets a compacted block table (the kept blocks, in
order, current block last) and the matching shorter sequence length.

* Builder (once per step): for each plain decode row whose request enables pruning, the
  law of ``controller.laws.pruning`` sets K (blocks kept) from the request's entropy; the
  compacted sequence lengths give the kernel's scheduler metadata once for all layers.
  Rows that are not plain decode (prefill chunks, short contexts) keep the dense table.
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

import copy
import logging
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from kernels.block_select import block_scores, select_blocks, selection_bias, summarize_blocks
from kernels.cpu_select import select_into_table
from workers.pruning_state import STATE

logger = logging.getLogger(__name__)


@dataclass
class PrunePlan:
    """Everything about this step's selection that does not depend on the layer (built once)."""

    rows: torch.Tensor  # attention rows pruned this step
    tokens: torch.Tensor  # their query token index
    physical: torch.Tensor  # [P, W] physical block ids of their logical blocks
    bias: torch.Tensor  # [P, W] w * log S_b; +inf sink and current block; -inf past the row's blocks
    keep: torch.Tensor  # [P] blocks kept
    kmax: int
    beyond: torch.Tensor  # [P, kmax] entries past keep[p]
    summarize: torch.Tensor  # physical blocks whose summaries every layer computes this step
    table: torch.Tensor  # scratch block table; each layer writes its choice into the pruned rows
    dense: Any = None  # unpruned metadata, for the dense first layers


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


class PrunedCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        plan, common = None, common_attn_metadata
        if self._prunable():
            started = time.perf_counter()
            plan, common = self._plan(common_attn_metadata)
            STATE.stats.selection_seconds += time.perf_counter() - started
        md = super().build(common_prefix_len, common, fast_build)
        if plan is not None and STATE.dense_layers > 0:
            plan.dense = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md.prune = plan
        return md

    def _prunable(self) -> bool:
        if self.is_cross_attention or self.is_encoder_only_attention or self.window_size != -1:
            return False
        if self.isa not in SUPPORTED_ISAS:
            if not getattr(self, "_warned", False):
                logger.warning("KV pruning off: CPU attention ISA %r has a key layout this version does not read", self.isa)
                self._warned = True
            return False
        return True

    _summary_valid: torch.Tensor | None = None  # per physical block: its key summaries are current

    def _summary_flags(self) -> torch.Tensor:
        if self._summary_valid is None:
            blocks = self.vllm_config.cache_config.num_gpu_blocks or 1
            self._summary_valid = torch.zeros(blocks, dtype=torch.bool)
        return self._summary_valid

    def _plan(self, cm: Any) -> tuple[PrunePlan | None, Any]:
        if not STATE.rows and self._summary_valid is None:
            return None, cm
        bs = self.block_size
        valid = self._summary_flags()
        slots = cm.slot_mapping[: cm.num_actual_tokens]
        fresh = slots[(slots >= 0) & (slots % bs == 0)] // bs
        if fresh.numel():
            valid[fresh.long()] = False
        if not STATE.rows:
            return None, cm

        starts = cm.query_start_loc_cpu.tolist()
        seq_lens = cm.seq_lens.tolist()
        batch_rows = cm.req_idx.tolist() if cm.req_idx is not None else range(cm.num_reqs)
        prefilling = cm.is_prefilling.tolist() if cm.is_prefilling is not None else [False] * cm.num_reqs
        rows, keep, nblocks, infos = [], [], [], []
        for row, batch_index in enumerate(batch_rows):
            request = STATE.rows.get(int(batch_index))
            args = getattr(request, "pruning", None)
            if args is None or starts[row + 1] - starts[row] != 1 or prefilling[row]:
                continue
            n = -(-seq_lens[row] // bs)
            track = STATE.request(request.key, args)
            k = track.decide(request.entropy, n, seq_lens[row])
            track.kept_log.append((k, n))
            STATE.stats.blocks_total += n
            STATE.stats.blocks_kept += k
            if k < n or STATE.always_select:
                rows.append(row)
                keep.append(k)
                nblocks.append(n)
                info = track.log_info(n, bs)
                infos.append(None if info is None else [track.info_weight * x for x in info])
        if not rows:
            return None, cm

        width = max(nblocks)
        rows_t = torch.tensor(rows)
        keep_t = torch.tensor(keep)
        nb_t = torch.tensor(nblocks)
        physical = cm.block_table_tensor[rows_t, :width].long()
        new_lens = cm.seq_lens.clone()
        fill = new_lens[rows_t] - (nb_t - 1) * bs
        new_lens[rows_t] = ((keep_t - 1) * bs + fill).to(new_lens.dtype)
        skipped = int((cm.seq_lens[rows_t] - new_lens[rows_t]).sum())
        self._count_savings(skipped)

        log_info = None
        if any(i is not None for i in infos):
            log_info = torch.zeros(len(rows), width)
            for j, info in enumerate(infos):
                if info is not None:
                    log_info[j, : len(info)] = torch.tensor(info)
        span = torch.arange(width)[None, :]
        interior = (span >= 1) & (span < nb_t[:, None] - 1)
        candidates = physical[interior].unique()
        summarize = candidates[~valid[candidates]]
        valid[summarize] = True  # every pruned layer summarizes them in this step, before reading

        kmax = int(keep_t.max())
        plan = PrunePlan(rows=rows_t, tokens=torch.tensor([starts[r] for r in rows]), physical=physical,
                         bias=selection_bias(nb_t, width, log_info), keep=keep_t, kmax=kmax,
                         beyond=torch.arange(kmax)[None, :] >= keep_t[:, None], summarize=summarize,
                         table=cm.block_table_tensor.clone())
        common = replace(cm, seq_lens=new_lens, max_seq_len=int(new_lens.max()),
                         seq_lens_cpu_upper_bound=None if cm.seq_lens_cpu_upper_bound is None else new_lens.clone())
        return plan, common

    def _count_savings(self, skipped_tokens: int) -> None:
        layers = max(len(self.layer_names) - STATE.dense_layers, 0)
        per_token_flops = 4 * self.num_heads * self.head_dim  # q.k and p.v, multiply-adds x 2
        per_token_bytes = 2 * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8
        STATE.stats.attention_flops_saved += skipped_tokens * per_token_flops * layers
        STATE.stats.kv_bytes_saved += skipped_tokens * per_token_bytes * layers


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")

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


class PrunedCPUAttentionBackendImpl(CPUAttentionBackendImpl):
    _summaries: torch.Tensor | None = None  # [KV heads, blocks, 2 * head_dim]: per-channel (max | min) of keys
    _layer_index: int | None = None

    def _index(self, layer: Any) -> int:
        if self._layer_index is None:
            found = _LAYER_INDEX.search(getattr(layer, "layer_name", ""))
            self._layer_index = int(found.group(1)) if found else 1 << 30
        return self._layer_index

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        plan = getattr(attn_metadata, "prune", None) if attn_metadata is not None else None
        if plan is None or self.attn_type != AttentionType.DECODER:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if self._index(layer) < STATE.dense_layers:
            return super().forward(layer, query, key, value, kv_cache, plan.dense, output,
                                   output_scale, output_block_scale)
        started = time.perf_counter()
        metadata = copy.copy(attn_metadata)
        metadata.block_table = self._compacted_table(query, kv_cache, attn_metadata.block_table, plan)
        STATE.stats.selection_seconds += time.perf_counter() - started
        return super().forward(layer, query, key, value, kv_cache, metadata, output,
                               output_scale, output_block_scale)

    def _compacted_table(self, query: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor,
                         plan: PrunePlan) -> torch.Tensor:
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
