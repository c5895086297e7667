"""Exact entropy and log-normalizer of CPU logits rows in one C call (kernels/csrc/entropy.c).

The same values as ``kernels.entropy.exact_entropy_and_log_norm`` on ``logits * scale`` (per row), in
two passes over each row and no temporaries; None where the library cannot be built here or the
input is not what it reads (float32 rows with unit column stride, positive scales), and then the
caller uses the torch path.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import cbuild


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.entropic_row_entropy.argtypes = [p, i64, i64, i64, p, p, p]
    lib.entropic_row_entropy.restype = ctypes.c_int


def load() -> ctypes.CDLL | None:
    return cbuild.load("entropy", _declare)


def exact_entropy_and_log_norm(logits: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(H, log sum exp) [rows] of each row of ``logits * scale[:, None]``; logits [rows, vocab] float32 on
    CPU, scale [rows] float32 > 0. None: not computed (see the module docstring)."""
    lib = load()
    if (lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(1) != 1 or scale.dtype != torch.float32 or not scale.is_contiguous()
            or scale.shape != logits.shape[:1]):
        return None
    rows, vocab = logits.shape
    entropy = torch.empty(rows, dtype=torch.float32)
    log_norm = torch.empty(rows, dtype=torch.float32)
    status = lib.entropic_row_entropy(logits.data_ptr(), rows, vocab, logits.stride(0), scale.data_ptr(),
                                      entropy.data_ptr(), log_norm.data_ptr())
    return (entropy, log_norm) if status == 0 else None
