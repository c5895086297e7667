"""Triton kernels for the entropy estimators (GPU path; the torch reference is kernels.entropy).

``exact_entropy``: one pass over each row with an online log-sum-exp: running max m,
A = sum e^(z-m), B = sum e^(z-m) (z-m); H = log A - B / A. Rescaling on a new max:
A <- s A, B <- s (B + A (m - m')), s = e^(m - m'). A row is split over several programs, each
folding its columns into (m, A, B), and a second kernel merges them with the same rescaling: with
one program per row, the loop's latency, not the memory, bounds the kernel (the launch shapes
measured on an H100 are in docs/results/gpu-kernels.md).

``topk_entropies``: torch.topk picks the k largest logits (already sorted); one program per
row turns them, the row's log-sum-exp (from the same online pass) and its count of finite
logits into H~ and H^. The top-k estimators still need the full log-sum-exp for the tail
mass, so on the GPU they save the weighted sum, not the pass over the vocabulary.

Kernels take static BLOCK sizes; tests run them under TRITON_INTERPRET=1 against torch.
"""
from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

_NEG_BIG = tl.constexpr(-3.0e38)  # a plain global is refused by the compiler (the interpreter allows it)


@triton.jit
def _partial_stats_kernel(z_ptr, stride, n_cols, chunk, part_ptr, BLOCK: tl.constexpr):
    # program (row, split) folds columns [split * chunk, (split + 1) * chunk) into (m, A, B, finite count)
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = z_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    m = tl.full((), _NEG_BIG, tl.float32)
    a = tl.zeros((), tl.float32)
    b = tl.zeros((), tl.float32)
    nfin = tl.zeros((), tl.int32)
    first = split * chunk
    last = tl.minimum(first + chunk, n_cols)
    for start in range(first, last, BLOCK):
        idx = start + offs
        z = tl.load(base + idx, mask=idx < last, other=float("-inf")).to(tl.float32)
        finite = z > _NEG_BIG
        m_new = tl.maximum(m, tl.max(tl.where(finite, z, _NEG_BIG), axis=0))
        scale = tl.exp(m - m_new)
        b = scale * (b + a * (m - m_new))
        a = a * scale
        d = tl.where(finite, z - m_new, 0.0)
        e = tl.where(finite, tl.exp(d), 0.0)
        a += tl.sum(e, axis=0)
        b += tl.sum(e * d, axis=0)
        nfin += tl.sum(finite.to(tl.int32), axis=0)
        m = m_new
    out = part_ptr + (row * tl.num_programs(1) + split) * 4
    tl.store(out, m)
    tl.store(out + 1, a)
    tl.store(out + 2, b)
    tl.store(out + 3, nfin.to(tl.float32))


@triton.jit
def _combine_stats_kernel(part_ptr, splits, lse_ptr, h_ptr, nfin_ptr, BLOCK_S: tl.constexpr):
    # the same rescaling as a new maximum inside the loop, across the row's splits
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    valid = offs < splits
    part = part_ptr + (row * splits + offs) * 4
    m = tl.load(part, mask=valid, other=_NEG_BIG)
    a = tl.load(part + 1, mask=valid, other=0.0)
    b = tl.load(part + 2, mask=valid, other=0.0)
    nfin = tl.load(part + 3, mask=valid, other=0.0)
    top = tl.max(m, axis=0)
    scale = tl.exp(m - top)
    total_a = tl.sum(a * scale, axis=0)
    total_b = tl.sum(scale * (b + a * (m - top)), axis=0)
    tl.store(lse_ptr + row, top + tl.log(total_a))
    tl.store(h_ptr + row, tl.log(total_a) - total_b / total_a)
    tl.store(nfin_ptr + row, tl.sum(nfin, axis=0).to(tl.int32))


@triton.jit
def _topk_entropy_kernel(top_ptr, k, lse_ptr, nfin_ptr, trunc_ptr, corr_ptr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    z = tl.load(top_ptr + row * k + offs, mask=offs < k, other=float("-inf")).to(tl.float32)
    finite = z > _NEG_BIG
    m = tl.max(tl.where(finite, z, _NEG_BIG), axis=0)
    d = tl.where(finite, z - m, 0.0)
    e = tl.where(finite, tl.exp(d), 0.0)
    a = tl.sum(e, axis=0)
    truncated = tl.log(a) - tl.sum(e * d, axis=0) / a
    lse_top = m + tl.log(a)
    tail = tl.minimum(tl.maximum(1.0 - tl.exp(lse_top - tl.load(lse_ptr + row)), 0.0), 1.0)
    kept = 1.0 - tail
    h_bin = tl.where(tail > 0, -tail * tl.log(tail), 0.0) + tl.where(kept > 0, -kept * tl.log(kept), 0.0)
    n_tail = tl.maximum(tl.load(nfin_ptr + row) - k, 1).to(tl.float32)
    tl.store(trunc_ptr + row, truncated)
    tl.store(corr_ptr + row, truncated + h_bin + tail * tl.log(n_tail))


@cache
def _multiprocessors(device: torch.device) -> int:
    # asked once per device: the logits processor calls this on every decode step
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _splits(rows: int, cols: int, block: int, device: torch.device, per_unit: int) -> int:
    """Programs per row: ``per_unit`` per multiprocessor in all, at most one per block of columns."""
    return max(1, min(triton.cdiv(per_unit * _multiprocessors(device), rows), triton.cdiv(cols, block)))


def _row_stats(logits: torch.Tensor, block: int = 2048, splits: int | None = None, num_warps: int = 4,
               per_unit: int = 32):
    z = logits.contiguous()
    rows, cols = z.shape
    splits = splits or _splits(rows, cols, block, z.device, per_unit)
    chunk = triton.cdiv(triton.cdiv(cols, splits), block) * block
    splits = triton.cdiv(cols, chunk)
    part = torch.empty(rows, splits, 4, device=z.device, dtype=torch.float32)
    _partial_stats_kernel[(rows, splits)](z, z.stride(0), cols, chunk, part, BLOCK=block, num_warps=num_warps)
    lse = torch.empty(rows, device=z.device, dtype=torch.float32)
    h = torch.empty_like(lse)
    nfin = torch.empty(rows, device=z.device, dtype=torch.int32)
    _combine_stats_kernel[(rows,)](part, splits, lse, h, nfin, BLOCK_S=triton.next_power_of_2(splits))
    return lse, h, nfin


def exact_entropy(logits: torch.Tensor, block: int = 2048, splits: int | None = None, num_warps: int = 4,
                  per_unit: int = 32) -> torch.Tensor:
    """H of each row. ``per_unit`` programs per multiprocessor in all (each folding ``block`` columns per
    iteration with ``num_warps`` warps), or ``splits`` programs per row if given."""
    return _row_stats(logits, block, splits, num_warps, per_unit)[1]


def topk_entropies(logits: torch.Tensor, k: int, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    k = min(k, logits.shape[-1])
    lse, _, nfin = _row_stats(logits, block)
    top = logits.float().topk(k, dim=-1).values.contiguous()
    truncated = torch.empty_like(lse)
    corrected = torch.empty_like(lse)
    _topk_entropy_kernel[(logits.shape[0],)](
        top, k, lse, nfin, truncated, corrected, BLOCK_K=triton.next_power_of_2(k)
    )
    return truncated, corrected
