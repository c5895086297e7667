"""Triton kernels for entropic KV pruning (GPU path; the torch reference is kernels.block_select).

``summarize_blocks``: per-channel key min/max of whole blocks, read straight from the paged
cache (one program per (block, kv head)); run for blocks that filled up since they were
last summarized.
``block_scores``: one program per (sequence, logical block) gathers the block's packed
(max | min) summaries through the block table and returns the same score as the torch path
(Quest bound max over query heads, times scale, plus the bias). Top-K selection is
kernels.block_select.select_blocks (torch.topk).

Static shapes: heads and channels are padded to powers of two. Tests run them under
TRITON_INTERPRET=1 against the torch reference (no GPU on the development machine).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.block_select import select_blocks

__all__ = ["block_scores", "summarize_blocks", "select_blocks"]


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
    """summaries [KVH, num_blocks, 2D] <- (max | min) over tokens of key_cache [num_blocks, KVH, T, D] (any strides)."""
    if block_ids.numel() == 0:
        return
    _, n_kv, block_size, d = key_cache.shape
    _summarize_kernel[(block_ids.numel(), n_kv)](
        key_cache, block_ids.to(torch.int64).contiguous(), summaries, summaries.shape[1], block_size, d,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
        BLOCK_T=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(d),
    )


@triton.jit
def _score_kernel(q_ptr, table_ptr, nblocks_ptr, sum_ptr, bias_ptr, out_ptr, n_heads, group, d, width, n_blocks, scale,
                  HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    p = tl.program_id(0)
    j = tl.program_id(1)
    n = tl.load(nblocks_ptr + p)
    if j >= n:
        tl.store(out_ptr + p * width + j, float("-inf"))
        return
    blk = tl.load(table_ptr + p * width + j).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < d)
    q = tl.load(q_ptr + (p * n_heads + offs_h[:, None]) * d + offs_d[None, :], mask=mask, other=0.0)
    kv = offs_h // group
    summary = (kv[:, None] * n_blocks + blk) * 2 * d + offs_d[None, :]
    hi = tl.load(sum_ptr + summary, mask=mask, other=0.0)
    lo = tl.load(sum_ptr + summary + d, mask=mask, other=0.0)
    upper = tl.sum(tl.maximum(q * hi, q * lo), axis=1)
    upper = tl.where(offs_h < n_heads, upper, float("-inf"))
    score = tl.max(upper, axis=0) * scale
    if HAS_BIAS:
        score += tl.load(bias_ptr + p * width + j)
    tl.store(out_ptr + p * width + j, score)


def block_scores(q: torch.Tensor, block_table: torch.Tensor, num_blocks: torch.Tensor, summaries: torch.Tensor,
                 scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [P, W] for queries q [P, H, D], physical ids block_table [P, W], summaries [KVH, blocks, 2D].

    Same value as kernels.block_select.block_scores on the gathered summaries; columns at or
    past num_blocks[p] are -inf.
    """
    rows, n_heads, d = q.shape
    width = block_table.shape[1]
    group = n_heads // summaries.shape[0]
    out = torch.empty(rows, width, device=q.device, dtype=torch.float32)
    has_bias = bias is not None
    _score_kernel[(rows, width)](
        q.float().contiguous(), block_table.contiguous(), num_blocks.contiguous(), summaries,
        bias.float().contiguous() if bias is not None else out, out, n_heads, group, d, width, summaries.shape[1],
        float(scale),
        HAS_BIAS=has_bias, BLOCK_H=triton.next_power_of_2(n_heads), BLOCK_D=triton.next_power_of_2(d),
    )
    return out
