"""Triton kernels for entropic KV pruning (GPU path; the torch reference is kernels.block_select).

``summarize_blocks``: per-channel key min/max of whole blocks, read straight from the paged
cache (one program per (block, kv head)); run for blocks that filled up since they were
last summarized.
``block_scores``: one program per (sequence, run of logical blocks) gathers the blocks' packed
(max | min) summaries through the block table and returns the same score as the torch path
(Quest bound max over query heads, times scale, plus the bias).
``select_into_table``: top-K, ordering and the table write fused in one kernel (on an H100, torch.topk
plus the sort took most of the selection's time: docs/results/gpu-kernels.md); rows too wide for one
program fall back to kernels.block_select.select_blocks (torch.topk).
``compact_table`` is one layer's whole selection as the GPU attention backend runs it
(workers.pruned_attention_gpu), kept free of vLLM so the GPU check (loadtest/gpu_check.py) times the
same calls on a machine without vLLM.

Static shapes: heads and channels are padded to powers of two. Tests run them under
TRITON_INTERPRET=1 against the torch reference and compile them for sm_90
(tests/test_triton_compile.py); `make gpu-check` runs them on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.block_select import select_blocks

__all__ = ["block_scores", "compact_table", "select_into_table", "summarize_blocks", "select_blocks"]


@triton.jit
def _summarize_kernel(keys_ptr, ids_ptr, out_ptr, n_blocks, block_size, d,
                      s_blk, s_head, s_tok, s_ch, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    g = tl.program_id(1)
    blk = tl.load(ids_ptr + i)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_t[:, None] < block_size) & (offs_d[None, :] < d)
    base = keys_ptr + blk * s_blk + g * s_head
    k = tl.load(base + offs_t[:, None] * s_tok + offs_d[None, :] * s_ch, mask=mask, other=0.0).to(tl.float32)
    lo = tl.min(tl.where(mask, k, float("inf")), axis=0)
    hi = tl.max(tl.where(mask, k, float("-inf")), axis=0)
    out = (g * n_blocks + blk) * 2 * d + offs_d  # [KVH, blocks, (max | min)]
    tl.store(out_ptr + out, hi, mask=offs_d < d)
    tl.store(out_ptr + out + d, lo, mask=offs_d < d)


def summarize_blocks(key_cache: torch.Tensor, block_ids: torch.Tensor, summaries: torch.Tensor) -> None:
    """summaries [KVH, num_blocks, 2D] <- (max | min) over tokens of key_cache [num_blocks, KVH, T, D] (any strides).

    ``summaries`` in the cache's dtype or float32 (the extremes are values of the cache, exact in either)."""
    if block_ids.numel() == 0:
        return
    _, n_kv, block_size, d = key_cache.shape
    _summarize_kernel[(block_ids.numel(), n_kv)](
        key_cache, block_ids.to(torch.int64).contiguous(), summaries, summaries.shape[1], block_size, d,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
        BLOCK_T=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(d),
    )


@triton.jit
def _score_kernel(q_ptr, table_ptr, nblocks_ptr, sum_ptr, bias_ptr, out_ptr, kv_heads, group, d, width, n_blocks,
                  scale, s_q_row, s_q_head, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (row p, BLOCK_N logical blocks): for each KV head, the bound of its query-head group against the
    # blocks' summaries as two small matmuls, [q+ | q-] x [kmax | kmin]^T; each summary is read once
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = offs_n < tl.load(nblocks_ptr + p)
    blk = tl.load(table_ptr + p * width + offs_n, mask=live, other=0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_g[:, None] < group) & (offs_d[None, :] < d)
    s_mask = live[:, None] & (offs_d[None, :] < d)
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    for kv in range(0, kv_heads):
        q = tl.load(q_ptr + p * s_q_row + (kv * group + offs_g[:, None]) * s_q_head + offs_d[None, :], mask=q_mask,
                    other=0.0)
        summary = sum_ptr + (kv * n_blocks + blk[:, None]) * 2 * d + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        hi = tl.load(summary, mask=s_mask, other=0.0)
        lo = tl.load(summary + d, mask=s_mask, other=0.0)
        zero = tl.zeros_like(q)
        # some Triton versions widen maximum/minimum of bf16 to float32; tl.dot wants both sides alike
        q_pos = tl.maximum(q, zero).to(hi.dtype)
        q_neg = tl.minimum(q, zero).to(hi.dtype)
        if IEEE:  # float32 summaries: no TF32 rounding, the bound stays a bound
            upper = tl.dot(q_pos, tl.trans(hi), input_precision="ieee")
            upper += tl.dot(q_neg, tl.trans(lo), input_precision="ieee")
        else:  # bf16/fp16: products are exact in the float32 accumulator
            upper = tl.dot(q_pos, tl.trans(hi))
            upper += tl.dot(q_neg, tl.trans(lo))
        upper = tl.where(offs_g[:, None] < group, upper, float("-inf"))  # [BLOCK_G, BLOCK_N]
        best = tl.maximum(best, tl.max(upper, axis=0))
    score = best * scale
    if HAS_BIAS:
        score += tl.load(bias_ptr + p * width + offs_n, mask=offs_n < width, other=0.0)
    tl.store(out_ptr + p * width + offs_n, tl.where(live, score, float("-inf")), mask=offs_n < width)


def block_scores(q: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor, summaries: torch.Tensor,
                 scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [P, W] for queries q [P, H, D], physical ids block_table [P, W], summaries [KVH, blocks, 2D].

    Same value as kernels.block_select.block_scores on the gathered summaries; columns at or
    past num_blocks[p] are -inf. The summaries may be in the cache's dtype: a key cache in bf16 has
    bf16 per-channel extremes, so storing them in bf16 loses nothing and halves what scoring reads.
    """
    rows, n_heads, d = q.shape
    width = block_table.shape[1]
    kv_heads = summaries.shape[0]
    q = q.to(summaries.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty(rows, width, device=q.device, dtype=torch.float32)
    # narrow tiles when few rows, so a single long sequence still spreads over the multiprocessors
    block_n = 16 if rows * triton.cdiv(width, 64) < 512 else 64
    _score_kernel[(rows, triton.cdiv(width, block_n))](
        q, block_table.contiguous(), num_blocks.contiguous(), summaries,
        bias.float().contiguous() if bias is not None else out, out, kv_heads, n_heads // kv_heads, d, width,
        summaries.shape[1], float(scale), q.stride(0), q.stride(1),
        HAS_BIAS=bias is not None, IEEE=summaries.dtype == torch.float32,
        BLOCK_G=max(16, triton.next_power_of_2(n_heads // kv_heads)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )
    return out


@triton.jit
def _select_kernel(scores_ptr, keep_ptr, physical_ptr, rows_ptr, table_ptr, width, s_table, BLOCK_W: tl.constexpr):
    # row p keeps its keep[p] highest scores: the keep[p]-th largest found by bisection on the scores' bits
    # (an order-preserving int32 image of the floats), ties at it broken by position; the kept blocks'
    # physical ids go to the row's table in ascending logical order (a prefix sum gives each its slot),
    # so the current block, the row's last, lands last. Top-K, sort, gather and table write in one pass.
    p = tl.program_id(0)
    offs = tl.arange(0, BLOCK_W)
    valid = offs < width
    score = tl.load(scores_ptr + p * width + offs, mask=valid, other=float("-inf"))
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and 0.0 are one score, not two bit patterns
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    key = tl.where(valid, key, -(2**32))  # below every float's image
    k = tl.load(keep_ptr + p).to(tl.int32)
    lo = tl.full((), -(2**31), tl.int64)
    hi = tl.full((), 2**31 - 1, tl.int64)
    for _ in range(32):  # largest t with at least k keys >= t
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((key >= mid).to(tl.int32), axis=0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = key > lo
    tied = key == lo
    take = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= k - tl.sum(above.to(tl.int32), axis=0)))
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    ids = tl.load(physical_ptr + p * width + offs, mask=take, other=0)
    row = tl.load(rows_ptr + p).to(tl.int64)
    tl.store(table_ptr + row * s_table + slot, ids.to(table_ptr.dtype.element_ty), mask=take)


# one program holds a row's scores in registers; wider rows (over 256K tokens at block 16) take the torch path
MAX_FUSED_WIDTH = 16384


def select_into_table(scores: torch.Tensor, keep: torch.Tensor, physical: torch.Tensor, table: torch.Tensor,
                      rows: torch.Tensor, kmax: int, beyond: torch.Tensor) -> None:
    """table[rows[p], :keep[p]] <- the physical ids of row p's keep[p] highest-scoring blocks, ascending order.

    scores and physical [P, W]; table [R, >= W] (the step's block table, int32); entries from keep[p] on are
    left as they were (the attention kernel reads only the compacted length). Same choice as
    kernels.block_select.select_blocks, ties broken towards lower positions.
    """
    width = scores.shape[1]
    if width > MAX_FUSED_WIDTH:
        chosen = physical.gather(1, select_blocks(scores, keep, kmax, beyond))
        table[rows, :kmax] = chosen.to(table.dtype)
        return
    block_w = max(16, triton.next_power_of_2(width))
    _select_kernel[(scores.shape[0],)](
        scores.contiguous(), keep.contiguous(), physical.contiguous(), rows.contiguous(), table, width,
        table.stride(0), BLOCK_W=block_w, num_warps=4 if block_w <= 2048 else 8 if block_w <= 8192 else 16)


def compact_table(query: torch.Tensor, keys: torch.Tensor, summaries: torch.Tensor, scale: float,
                  summarize: torch.Tensor, physical: torch.Tensor, num_blocks: torch.Tensor, bias: torch.Tensor,
                  keep: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, kmax: int, beyond: torch.Tensor) -> None:
    """One layer's selection, written into the block table the attention kernel reads. No host sync.

    query [P, H, D] (the pruned rows' decode queries), keys [blocks, KVH, T, D] (any strides),
    summaries [KVH, blocks, 2D] (updated in place for the ``summarize`` blocks), physical and bias [P, W],
    table rows ``rows`` [P] get the kept blocks: the step's plan (workers.pruning_plan.PrunePlan).
    """
    summarize_blocks(keys, summarize, summaries)
    scores = block_scores(query, physical, num_blocks, summaries, scale, bias)
    select_into_table(scores, keep, physical, table, rows, kmax, beyond)
