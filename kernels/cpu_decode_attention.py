"""Decode attention for pure-decode steps over vLLM's CPU KV cache (kernels/csrc/decode_attention.c), built
and loaded by kernels.cbuild.

The caller (workers.pruned_attention) uses vLLM's own kernel wherever this answers False: a bf16 cache on a CPU
without AVX512-BF16, a float32 one on a CPU without AVX2 and FMA, another dtype, query, output and cache in
different dtypes, an engine running more than one thread where the library was
built without OpenMP (it would then run on the calling thread alone), fewer (row, KV head) pairs than the
engine has threads (each pair is one thread's work here, where vLLM's kernel also splits a sequence between
threads), or shapes outside the kernel's limits. With OpenMP it runs on as many of the pool's threads as
torch's intra-op count, as vLLM's kernels do.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels import cbuild
from kernels.hardware import cpu_flags


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.entropic_decode_attention.argtypes = [p, i64, p, i64, p, i64, i32, i32, i32, i32, p, i64, p, i32,
                                              ctypes.c_float, i32, i32]
    lib.entropic_decode_attention.restype = i32
    lib.entropic_decode_attention_parallel.argtypes = []
    lib.entropic_decode_attention_parallel.restype = i32


# the C kernel's variant for each cache dtype, and the CPU flags it needs
_KINDS = {torch.bfloat16: (1, frozenset({"avx512_bf16", "avx512bw"})), torch.float32: (2, frozenset({"avx2", "fma"}))}


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this CPU runs the kernel on a cache of this dtype (bf16: its bf16 dot products; float32: AVX2 FMA);
    the library is built on first use."""
    return dtype in _KINDS and _KINDS[dtype][1] <= cpu_flags()


@functools.cache  # one library per process: asked once, not in each layer of each step
def parallel() -> bool:
    """Whether the library runs on several threads (built with OpenMP); False also where it cannot be built."""
    lib = cbuild.load("decode_attention", _declare)
    return lib is not None and bool(lib.entropic_decode_attention_parallel())


def decode_attention(query: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> bool:
    """Attention of one query token per row: output[r] = softmax(scale q[r] K^T) V over row r's seq_lens[r]
    tokens, read through block_table[r] from the "vec" cache layout.

    query [rows, heads, d] bf16 or float32 (each row's heads and channels contiguous), output the same shape
    and dtype (or [rows, heads * d]); kv_cache [blocks, KV heads, block_size, 2 d] in the same dtype;
    block_table [>= rows, W] int32 with contiguous rows; seq_lens [rows] int32. Returns False (nothing
    written) where it does not run.
    """
    rows = seq_lens.numel()
    if (not available(kv_cache.dtype) or query.dtype != kv_cache.dtype or output.dtype != kv_cache.dtype
            or query.dim() != 3
            or query.shape[0] < rows or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous()
            or block_table.dtype != torch.int32 or block_table.stride(1) != 1 or not kv_cache.is_contiguous()):
        return False
    heads, d = query.shape[1:]
    out = output.view(output.shape[0], heads, d) if output.dim() == 2 else output
    if query.stride(2) != 1 or query.stride(1) != d or out.stride(2) != 1 or out.stride(1) != d:
        return False
    blocks, kv_heads, block_size, two_d = kv_cache.shape
    if two_d != 2 * d or heads % kv_heads:
        return False
    lib = cbuild.load("decode_attention", _declare)
    threads = torch.get_num_threads()
    if lib is None or (threads > 1 and (not parallel() or rows * kv_heads < threads)):
        return False
    status = lib.entropic_decode_attention(
        query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0), kv_cache.data_ptr(), blocks, kv_heads,
        block_size, d, heads // kv_heads, block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), rows,
        float(scale), _KINDS[kv_cache.dtype][0], threads)
    return status == 0
