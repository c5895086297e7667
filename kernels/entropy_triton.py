"""Triton kernels for the entropy estimators (GPU path; the torch reference is kernels.entropy).

``exact_entropy``: one pass over each row with an online log-sum-exp: running max m,
A = sum e^(z-m), B = sum e^(z-m) (z-m); H = log A - B / A. Rescaling on a new max:
A <- s A, B <- s (B + A (m - m')), s = e^(m - m').

``topk_entropies``: torch.topk picks the k largest logits (already sorted); one program per
row turns them, the row's log-sum-exp (from the same online pass) and its count of finite
logits into H~ and H^. The top-k estimators still need the full log-sum-exp for the tail
mass, so on the GPU they save the weighted sum, not the pass over the vocabulary.

Kernels take static BLOCK sizes; tests run them under TRITON_INTERPRET=1 against torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG_BIG = -3.0e38


@triton.jit
def _row_stats_kernel(z_ptr, stride, n_cols, lse_ptr, h_ptr, nfin_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    m = tl.full((), _NEG_BIG, tl.float32)
    a = tl.zeros((), tl.float32)
    b = tl.zeros((), tl.float32)
    nfin = tl.zeros((), tl.int32)
    for start in range(0, n_cols, BLOCK):
        idx = start + offs
        z = tl.load(base + idx, mask=idx < n_cols, other=float("-inf")).to(tl.float32)
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
    tl.store(lse_ptr + row, m + tl.log(a))
    tl.store(h_ptr + row, tl.log(a) - b / a)
    tl.store(nfin_ptr + row, nfin)


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


def _row_stats(logits: torch.Tensor, block: int = 1024):
    z = logits.contiguous()
    rows, cols = z.shape
    lse = torch.empty(rows, device=z.device, dtype=torch.float32)
    h = torch.empty_like(lse)
    nfin = torch.empty(rows, device=z.device, dtype=torch.int32)
    _row_stats_kernel[(rows,)](z, z.stride(0), cols, lse, h, nfin, BLOCK=block)
    return lse, h, nfin


def exact_entropy(logits: torch.Tensor, block: int = 1024) -> torch.Tensor:
    return _row_stats(logits, block)[1]


def topk_entropies(logits: torch.Tensor, k: int, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    k = min(k, logits.shape[-1])
    lse, _, nfin = _row_stats(logits, block)
    top = logits.float().topk(k, dim=-1).values.contiguous()
    truncated = torch.empty_like(lse)
    corrected = torch.empty_like(lse)
    _topk_entropy_kernel[(logits.shape[0],)](
        top, k, lse, nfin, truncated, corrected, BLOCK_K=triton.next_power_of_2(k)
    )
    return truncated, corrected
