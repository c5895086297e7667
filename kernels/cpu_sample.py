"""One draw from each CPU logits row's softmax in one C call (kernels/csrc/sample.c), by inverse CDF.

The same distribution as vLLM's CPU sampler (Gumbel-max over the row), drawn with one exp per token instead
of a random number and two logs per token; ``sample_rows_filtered`` draws after vLLM's min-p, top-k and top-p,
found without a softmax for min-p or a sort of the vocabulary. None where the library cannot be built here,
the input is not what it reads (float32 rows with unit column stride), or some row has no distribution (every
logit -inf, or a +inf or nan): the caller then samples with vLLM's own path.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import cbuild

_BLOCK = 16  # kernels/csrc/sample.c's BLOCK: the caller sizes the block-sum workspace by it


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.entropic_sample_rows.argtypes = [p, i64, i64, i64, p, p, p]
    lib.entropic_sample_rows.restype = ctypes.c_int
    lib.entropic_sample_rows_filtered.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, p]
    lib.entropic_sample_rows_filtered.restype = ctypes.c_int


def load() -> ctypes.CDLL | None:
    return cbuild.load("sample", _declare)


def _readable(logits: torch.Tensor, seeds: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and seeds.dtype == torch.int64 and seeds.is_contiguous()
            and seeds.shape == logits.shape[:1])


def sample_rows(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor | None:
    """Token ids [rows] (int64), row r drawn from softmax(logits[r]) with the uniform that ``seeds[r]``
    makes; logits [rows, vocab] float32 on CPU, seeds [rows] int64 (any values: equal seeds, equal draws)."""
    lib = load()
    if lib is None or not _readable(logits, seeds):
        return None
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    block_sums = torch.empty(-(-vocab // _BLOCK), dtype=torch.float32)
    status = lib.entropic_sample_rows(logits.data_ptr(), rows, vocab, logits.stride(0), seeds.data_ptr(),
                                      block_sums.data_ptr(), out.data_ptr())
    return out if status == 0 else None


def sample_rows_filtered(logits: torch.Tensor, seeds: torch.Tensor, top_k: torch.Tensor | None,
                         top_p: torch.Tensor | None, min_p: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Token ids [rows] as ``sample_rows``, each row drawn after vLLM's min-p, top-k and top-p (min_p [rows], 0
    for none; top_k [rows], k >= vocab or k <= 0 for none; top_p [rows], 1 for none; each None for no row), and
    the threshold of each row [rows] float32: the row keeps its tokens with logit >= threshold (-inf: all).
    Ties at the top-p boundary are kept whole (kernels/csrc/sample.c)."""
    lib = load()
    if lib is None or not _readable(logits, seeds):
        return None
    rows, vocab = logits.shape
    k = None if top_k is None else top_k.to(torch.int64).contiguous()
    p = None if top_p is None else top_p.to(torch.float32).contiguous()
    mp = None if min_p is None else min_p.to(torch.float32).contiguous()
    if any(t is not None and t.shape != (rows,) for t in (k, p, mp)):
        return None
    out = torch.empty(rows, dtype=torch.int64)
    thresholds = torch.empty(rows, dtype=torch.float32)
    block_sums = torch.empty(-(-vocab // _BLOCK), dtype=torch.float32)
    status = lib.entropic_sample_rows_filtered(
        logits.data_ptr(), rows, vocab, logits.stride(0), seeds.data_ptr(), None if mp is None else mp.data_ptr(),
        None if k is None else k.data_ptr(), None if p is None else p.data_ptr(),
        block_sums.data_ptr(), thresholds.data_ptr(), out.data_ptr())
    return (out, thresholds) if status == 0 else None
