"""What the CPU and GPU pruned attention backends share (adapter; vllm 0.32.0).

``PruningPlanner`` is mixed into a vLLM attention metadata builder. Once per step it decides,
for each plain decode row whose request enables pruning, how many blocks K the row keeps (the
law of ``controller.laws.pruning`` on the request's entropy), rewrites the common metadata's
sequence lengths to the compacted ones (so the backend's kernel metadata is computed once for
all layers) and returns the ``PrunePlan`` the layers use to choose *which* K blocks. Rows that
are not plain decode (prefill chunks, short contexts) keep the dense table.

vLLM hands the builder no request ids; its rows are the input-batch rows, which the logits
processor publishes in ``workers.pruning_state.STATE`` (see there).

``PrunedLayers`` is mixed into the backend's attention impl: pruned decode rows of each layer get
the plan's compacted block table (the backend's ``_compacted_table`` chooses this layer's blocks),
the first ``STATE.dense_layers`` layers and everything else go to vLLM's forward unchanged.
"""
from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType

from kernels.block_select import selection_bias
from workers.pruning_state import STATE


@dataclass
class PrunePlan:
    """Everything about this step's selection that does not depend on the layer (built once)."""

    rows: torch.Tensor  # attention rows pruned this step
    tokens: torch.Tensor  # their query token index
    physical: torch.Tensor  # [P, W] physical block ids of their logical blocks
    num_blocks: torch.Tensor  # [P] blocks each row holds
    bias: torch.Tensor  # [P, W] w * log S_b; +inf sink and current block; -inf past the row's blocks
    keep: torch.Tensor  # [P] blocks kept
    kmax: int
    beyond: torch.Tensor  # [P, kmax] entries past keep[p]
    summarize: torch.Tensor  # physical blocks whose summaries every layer computes this step
    table: torch.Tensor  # scratch block table; each layer writes its choice into the pruned rows
    dense: Any = None  # unpruned metadata, for the dense first layers
    pruned: Any = None  # the step's metadata on ``table``: copied once, for all the pruned layers


class PruningPlanner:
    """Mixin for a vLLM attention metadata builder, listed before it (``build`` wraps the builder's own).

    Uses the base class's ``kv_cache_spec``, ``vllm_config`` and ``layer_names``, and ``block_size``,
    which the CPU and Triton builders both set."""

    _summary_valid: torch.Tensor | None = None  # per physical block: its key summaries are current
    # set by the vLLM builder this is mixed into
    vllm_config: Any
    kv_cache_spec: Any
    layer_names: Any
    block_size: int

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        """vLLM's metadata for the compacted lengths, carrying this step's plan as ``prune`` (None: dense)."""
        plan, common = None, common_attn_metadata
        if self._prunable():
            started = time.perf_counter()
            plan, common = self._plan(common_attn_metadata)
            STATE.stats.selection_seconds += time.perf_counter() - started
        md = super().build(common_prefix_len, common, fast_build)  # type: ignore[misc]  # the vLLM builder's
        if plan is not None and STATE.dense_layers > 0:
            plan.dense = super().build(common_prefix_len, common_attn_metadata, fast_build)  # type: ignore[misc]
        md.prune = plan
        return md

    def _prunable(self) -> bool:
        raise NotImplementedError  # the backend says which of its layers it can prune

    def _summary_flags(self, device: torch.device) -> torch.Tensor:
        if self._summary_valid is None:
            blocks = self.vllm_config.cache_config.num_gpu_blocks or 1
            self._summary_valid = torch.zeros(blocks, dtype=torch.bool, device=device)
        return self._summary_valid

    def _plan(self, cm: Any) -> tuple[PrunePlan | None, Any]:
        if not STATE.rows and self._summary_valid is None:
            return None, cm
        bs = self.block_size
        device = cm.block_table_tensor.device
        valid = self._summary_flags(device)
        slots = cm.slot_mapping[: cm.num_actual_tokens]
        fresh = slots[(slots >= 0) & (slots % bs == 0)] // bs
        if fresh.numel():
            valid[fresh.long()] = False  # the block pool recycled these blocks: their summaries are stale
        if not STATE.rows:
            return None, cm

        starts = cm.query_start_loc_cpu.tolist()
        seq_lens = cm.seq_lens.tolist()  # one device sync per step on GPU, none on CPU
        batch_rows = cm.req_idx.tolist() if cm.req_idx is not None else range(cm.num_reqs)
        prefilling = cm.is_prefilling.tolist() if cm.is_prefilling is not None else [False] * cm.num_reqs
        rows, keep, nblocks, infos = [], [], [], []
        for row, batch_index in enumerate(batch_rows):
            request = STATE.rows.get(int(batch_index))
            args = getattr(request, "pruning", None)
            if request is None or args is None or starts[row + 1] - starts[row] != 1 or prefilling[row]:
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
                infos.append(None if info is None else info * track.info_weight)
        if not rows:
            return None, cm

        width = max(nblocks)
        rows_t = torch.tensor(rows)
        keep_t = torch.tensor(keep)
        nb_t = torch.tensor(nblocks)
        seq_t = torch.tensor([seq_lens[r] for r in rows])
        physical = cm.block_table_tensor[rows_t.to(device), :width].long()
        fill = seq_t - (nb_t - 1) * bs
        compacted = (keep_t - 1) * bs + fill
        self._count_savings(int((seq_t - compacted).sum()))
        new_lens = cm.seq_lens.clone()
        new_lens[rows_t.to(device)] = compacted.to(device=device, dtype=new_lens.dtype)

        log_info = None
        if any(i is not None for i in infos):
            log_info = torch.zeros(len(rows), width)
            for j, info in enumerate(infos):
                if info is not None:
                    log_info[j, : len(info)] = info
        span = torch.arange(width, device=device)[None, :]
        interior = (span >= 1) & (span < nb_t.to(device)[:, None] - 1)
        candidates = physical[interior].unique()
        summarize = candidates[~valid[candidates]]
        valid[summarize] = True  # every pruned layer summarizes them in this step, before reading

        kmax = int(keep_t.max())
        plan = PrunePlan(rows=rows_t.to(device), tokens=torch.tensor([starts[r] for r in rows], device=device),
                         physical=physical, num_blocks=nb_t.to(device),
                         bias=selection_bias(nb_t, width, log_info).to(device), keep=keep_t.to(device), kmax=kmax,
                         beyond=(torch.arange(kmax)[None, :] >= keep_t[:, None]).to(device), summarize=summarize,
                         table=cm.block_table_tensor.clone())
        pruned = set(rows)
        max_seq_len = max(max((n for r, n in enumerate(seq_lens) if r not in pruned), default=0),
                          int(compacted.max()))
        upper = cm.seq_lens_cpu_upper_bound
        if upper is not None:
            upper = upper.clone()
            upper[rows_t] = compacted.to(upper.dtype)
        common = replace(cm, seq_lens=new_lens, max_seq_len=max_seq_len, seq_lens_cpu_upper_bound=upper)
        return plan, common

    def _count_savings(self, skipped_tokens: int) -> None:
        spec, model = self.kv_cache_spec, self.vllm_config.model_config
        layers = max(len(self.layer_names) - STATE.dense_layers, 0)
        heads = model.get_num_attention_heads(self.vllm_config.parallel_config)
        per_token_flops = 4 * heads * spec.head_size  # q.k and p.v, multiply-adds x 2
        per_token_bytes = 2 * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize
        STATE.stats.attention_flops_saved += skipped_tokens * per_token_flops * layers
        STATE.stats.kv_bytes_saved += skipped_tokens * per_token_bytes * layers


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class PrunedLayers:
    """Mixin for a vLLM attention impl, listed before it (``forward`` wraps the impl's own)."""

    _summaries: torch.Tensor | None = None  # [KV heads, blocks, 2 * head size] float32: per-channel (max | min) of keys
    _layer_index: int | None = None
    attn_type: Any  # set by the vLLM impl this is mixed into

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if attn_metadata is None or not self._prunes():  # warm-up, or not a decoder's self-attention
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,  # type: ignore[misc]
                                   output_scale, output_block_scale)
        plan = getattr(attn_metadata, "prune", None)
        if plan is None:
            metadata = attn_metadata
        elif self._index(layer) < STATE.dense_layers:
            metadata = plan.dense
        else:
            started = time.perf_counter()
            if plan.pruned is None:
                plan.pruned = copy.copy(attn_metadata)
            metadata = plan.pruned
            metadata.block_table = self._compacted_table(layer, query, kv_cache, plan)
            STATE.stats.selection_seconds += time.perf_counter() - started
        # pruned or not, a step the backend's own decode kernel suits is its (the kernel reads the same cache)
        if output_scale is None and output_block_scale is None and self._decode(layer, query, kv_cache, metadata,
                                                                                output):
            return output
        return super().forward(layer, query, key, value, kv_cache, metadata, output,  # type: ignore[misc]
                               output_scale, output_block_scale)

    def _decode(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                output: torch.Tensor) -> bool:
        """A backend's own kernel for a decoder step's attention (pruned or dense), where it has one and the step
        suits it; False (nothing written): the vLLM backend's forward."""
        return False

    def _prunes(self) -> bool:
        return self.attn_type == AttentionType.DECODER

    def _index(self, layer: Any) -> int:
        if self._layer_index is None:
            found = _LAYER_INDEX.search(getattr(layer, "layer_name", ""))
            self._layer_index = int(found.group(1)) if found else 1 << 30
        return self._layer_index

    def _compacted_table(self, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor,
                         plan: PrunePlan) -> torch.Tensor:
        raise NotImplementedError  # the backend's selection for its cache layout
