"""The fused CPU block selection (kernels/csrc/block_select.c), built and loaded by kernels.cbuild.

Where the library cannot be built the caller falls back to the torch path (kernels.block_select),
which computes the same selection. Rows run on as many of the OpenMP pool's threads as torch's intra-op
count where the build has OpenMP (kernels/cbuild.py), else on the calling thread.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import cbuild
from kernels.hardware import cpu_flags

# the CPU flags of the kernel's bf16 dot-product scoring (a bf16 query and bf16 summaries; else float FMA)
_BF16_DOT = frozenset({"avx512_bf16", "avx512bw"})
_FLOATS = (torch.float32, torch.bfloat16)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.entropic_select_blocks.argtypes = [p, i32, i64, p, p, i32, i64, p, p, p, i32, i32, i32, i32, i32,
                                           ctypes.c_float, p, i64, p, i32, i32]
    lib.entropic_select_blocks.restype = i32


def load() -> ctypes.CDLL | None:
    """The library, or None (logged once) when it cannot be built here."""
    return cbuild.load("block_select", _declare)


# The plan's tensors (all but query and summaries) are the same objects in every layer of a step: their checks and
# pointers are kept from the step's first call, with the tensors (so none is freed and its id reused meanwhile).
_step: tuple[tuple[torch.Tensor, ...], tuple[int, ...] | None] = ((), None)


def _step_args(tokens: torch.Tensor, physical: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor,
               table: torch.Tensor, rows: torch.Tensor) -> tuple[int, ...] | None:
    global _step
    tensors = (tokens, physical, bias, keep, table, rows)
    kept, args = _step
    if len(kept) == len(tensors) and all(a is b for a, b in zip(kept, tensors)):
        return args
    expected = ((physical, torch.int64), (bias, torch.float32), (keep, torch.int64), (rows, torch.int64),
                (tokens, torch.int64))
    args = None
    if (table.dtype == torch.int32 and table.stride(1) == 1
            and all(t.dtype == dtype and t.is_contiguous() for t, dtype in expected)):
        args = (tokens.data_ptr(), physical.data_ptr(), bias.data_ptr(), keep.data_ptr(), len(rows),
                physical.shape[1], table.data_ptr(), table.stride(0), rows.data_ptr())
    _step = (tensors, args)
    return args


def select_into_table(query: torch.Tensor, tokens: torch.Tensor, summaries: torch.Tensor, physical: torch.Tensor,
                      bias: torch.Tensor, keep: torch.Tensor, scale: float, table: torch.Tensor,
                      rows: torch.Tensor) -> bool:
    """Score, select and write the kept blocks of each pruned row into ``table`` (vLLM's int32 block table).

    query [T, H, D] float32 or bf16 (the layer's query; each token's heads and channels contiguous), of which
    row p scores with token tokens[p], its H heads in KV-head groups; summaries [KVH, NB, 2D] float32 or bf16;
    physical [P, W] int64; bias [P, W] float32; tokens, keep, rows [P] int64; table [R, max_blocks] int32
    with contiguous rows. Returns False (nothing written) when the library is unavailable or the shapes
    are outside its limits.
    """
    if query.dim() != 3 or query.dtype not in _FLOATS or summaries.dtype not in _FLOATS:
        return False
    heads, d = query.shape[1:]
    if query.stride(2) != 1 or query.stride(1) != d or not summaries.is_contiguous():
        return False
    step = _step_args(tokens, physical, bias, keep, table, rows)
    lib = load()
    if step is None or lib is None:
        return False
    t_ptr, physical_ptr, bias_ptr, keep_ptr, count, width, table_ptr, table_stride, rows_ptr = step
    kv_heads = summaries.shape[0]
    status = lib.entropic_select_blocks(
        query.data_ptr(), query.dtype == torch.bfloat16, query.stride(0), t_ptr, summaries.data_ptr(),
        summaries.dtype == torch.bfloat16, summaries.shape[1], physical_ptr, bias_ptr, keep_ptr, count, kv_heads,
        heads // kv_heads, d, width, float(scale), table_ptr, table_stride, rows_ptr, torch.get_num_threads(),
        _BF16_DOT <= cpu_flags())
    return status == 0
