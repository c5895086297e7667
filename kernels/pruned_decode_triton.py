"""Pruned paged-decode attention in Triton: a reference kernel, not what serves.

Serving on a GPU hands the compacted table to vLLM's own ``unified_attention``
(workers.pruned_attention_gpu), which is far faster (measured in docs/results/gpu-kernels.md):
this one has no split of the sequence across programs and re-reads each KV head's blocks once per
query head. It stays as a second, independent check of the compacted-table contract.

One decode query per sequence attends to the blocks its compacted block table lists: the
kept blocks in ascending logical order, the current (partially filled) block last, exactly
the table the CPU path hands vLLM's kernel (workers.pruned_attention). ``seq_lens`` are the
compacted lengths: (kept - 1) * block_size + tokens in the current block.

Layout is vLLM's GPU paged cache (FlashAttention backends): key_cache and value_cache
[num_blocks, block_size, KV heads, head_dim]. One program per (sequence, query head) walks
the kept blocks with the online softmax (running max and normaliser), so a pruned row reads
only K blocks of keys and values: the KV traffic drops by the kept fraction. Static shapes:
block size and head size are compile-time constants, padded to powers of two.

The torch reference is ``reference_decode``; tests run the kernel under TRITON_INTERPRET=1
(no GPU on the development machine).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pruned_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, scale, group, d,
                          s_q_seq, s_q_head, s_c_blk, s_c_tok, s_c_head, s_t_seq, s_o_seq, s_o_head,
                          BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < d
    q = tl.load(q_ptr + seq * s_q_seq + head * s_q_head + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    length = tl.load(lens_ptr + seq)
    n_blocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    m = tl.full((), float("-inf"), tl.float32)
    norm = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for i in range(0, n_blocks):
        block = tl.load(table_ptr + seq * s_t_seq + i).to(tl.int64)
        valid = (i * BLOCK_SIZE + offs_t) < length
        base = block * s_c_blk + kv_head * s_c_head
        addr = base + offs_t[:, None] * s_c_tok + offs_d[None, :]
        mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + addr, mask=mask, other=0.0).to(tl.float32)
        logits = tl.sum(k * q[None, :], axis=1) * scale
        logits = tl.where(valid, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=0))
        p = tl.exp(logits - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + addr, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        norm = norm * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / norm
    tl.store(out_ptr + seq * s_o_seq + head * s_o_head + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def pruned_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention output [S, H, D] of one decode query per sequence, q [S, H, D], over the compacted table."""
    seqs, heads, d = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    if key_cache.stride(3) != 1 or value_cache.stride() != key_cache.stride() or q.stride(2) != 1:
        raise ValueError("expected channel-contiguous q and caches with identical strides")
    if block_size & (block_size - 1):
        raise ValueError(f"block size {block_size} is not a power of two")
    out = torch.empty_like(q)
    _pruned_decode_kernel[(seqs, heads)](
        q, key_cache, value_cache, table, seq_lens, out, scale, heads // kv_heads, d,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), table.stride(0),
        out.stride(0), out.stride(1), BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(d))
    return out


def reference_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention in torch: gather the listed blocks, softmax over the first seq_len tokens."""
    seqs, heads, d = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    for s in range(seqs):
        length = int(seq_lens[s])
        blocks = table[s, : -(-length // block_size)].long()
        k = key_cache[blocks].reshape(-1, kv_heads, d)[:length].float()  # [T, KVH, D]
        v = value_cache[blocks].reshape(-1, kv_heads, d)[:length].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [T, H, D]
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[s].float(), k) * scale, dim=-1)
        out[s] = torch.einsum("ht,thd->hd", weights, v).to(q.dtype)
    return out
