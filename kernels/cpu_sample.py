"""One draw from each CPU logits row's softmax in one C call (kernels/csrc/sample.c), by inverse CDF.

The same distribution as vLLM's CPU sampler without top-k/top-p (Gumbel-max over the row), drawn with one
exp per token instead of a random number and two logs per token. None where the library cannot be built
here, the input is not what it reads (float32 rows with unit column stride), or some row has no
distribution (every logit -inf, or a +inf or nan): the caller then samples with vLLM's own path.
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


def load() -> ctypes.CDLL | None:
    return cbuild.load("sample", _declare)


def sample_rows(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor | None:
    """Token ids [rows] (int64), row r drawn from softmax(logits[r]) with the uniform that ``seeds[r]``
    makes; logits [rows, vocab] float32 on CPU, seeds [rows] int64 (any values: equal seeds, equal draws)."""
    lib = load()
    if (lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(1) != 1 or seeds.dtype != torch.int64 or not seeds.is_contiguous()
            or seeds.shape != logits.shape[:1]):
        return None
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    block_sums = torch.empty(-(-vocab // _BLOCK), dtype=torch.float32)
    status = lib.entropic_sample_rows(logits.data_ptr(), rows, vocab, logits.stride(0), seeds.data_ptr(),
                                      block_sums.data_ptr(), out.data_ptr())
    return out if status == 0 else None
