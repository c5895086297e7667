"""Key summaries read in place from vLLM's CPU cache (kernels/csrc/block_summary.c), built and loaded by
kernels.cbuild.

Where the library cannot be built, or the cache's dtype or layout is not one it reads, the caller
uses the torch path (kernels.block_select.summarize_blocks over workers.pruned_attention.key_cache_view),
which computes the same summaries.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import cbuild

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
LAYOUTS = {"vec": 0, "amx": 1}  # vLLM's CPU attention ISA names


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.entropic_summarize_blocks.argtypes = [p, i32, i32, i64, i64, i32, i32, i32, p, i64, p, i64, i32]
    lib.entropic_summarize_blocks.restype = i32


def load() -> ctypes.CDLL | None:
    """The library, or None (logged once) when it cannot be built here."""
    return cbuild.load("block_summary", _declare)


def summarize_into(kv_cache: torch.Tensor, isa: str, block_ids: torch.Tensor, summaries: torch.Tensor) -> bool:
    """summaries [KVH, NB, 2D] <- per-channel (max | min) of the keys of ``block_ids`` (int64).

    ``kv_cache`` is vLLM's CPU cache for one layer, [NB, KVH, block_size, 2D], keys first in each block
    and head, in the layout of ``isa``; ``summaries`` has the cache's dtype (the extremes of its values
    are its values: nothing is rounded). Returns False (nothing written) where this cannot run.
    """
    if kv_cache.dtype not in DTYPES or isa not in LAYOUTS or summaries.dtype != kv_cache.dtype:
        return False
    blocks, kv_heads, block_size, two_d = kv_cache.shape
    if (kv_cache.stride(3) != 1 or kv_cache.stride(2) != two_d or not summaries.is_contiguous()
            or summaries.shape != (kv_heads, blocks, two_d) or block_ids.dtype != torch.int64):
        return False
    lib = load()
    if lib is None:
        return False
    ids = block_ids.contiguous()
    status = lib.entropic_summarize_blocks(
        kv_cache.data_ptr(), DTYPES[kv_cache.dtype], LAYOUTS[isa], kv_cache.stride(0), kv_cache.stride(1), kv_heads,
        block_size, two_d // 2, ids.data_ptr(), ids.numel(), summaries.data_ptr(), blocks, torch.get_num_threads())
    return status == 0
