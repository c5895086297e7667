"""A float32 linear layer over weights stored as bfloat16 (kernels/csrc/linear_bf16w.c), built and loaded by
kernels.cbuild.

Where a model's checkpoint is bfloat16 and the engine runs float32, every weight is a bfloat16 value widened to
float32, and a decode step, a pass over all weights for a few rows, reads twice the bytes it needs. The kernel
reads the bfloat16 bit patterns and computes in float32: the same weights and arithmetic, half the bytes.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels import cbuild
from kernels.hardware import cpu_flags

# output columns per panel of each loaded build: two vectors of the instruction set it was built for
_panel: dict[ctypes.CDLL, int] = {}


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.entropic_bf16w_panel.argtypes = []
    lib.entropic_bf16w_panel.restype = ctypes.c_int
    lib.entropic_bf16w_rows.argtypes = []
    lib.entropic_bf16w_rows.restype = ctypes.c_int
    lib.entropic_pack_bf16w.argtypes = [p, i64, i64, p]
    lib.entropic_pack_bf16w.restype = None
    lib.entropic_linear_bf16w.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, ctypes.c_int]
    lib.entropic_linear_bf16w.restype = None
    _panel[lib] = lib.entropic_bf16w_panel()


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: AVX2 and FMA (the scalar build would be slower than the float32 GEMM it
    stands in for), and the library builds."""
    return {"avx2", "fma"} <= cpu_flags() and cbuild.load("linear_bf16w", _declare) is not None


def _library(lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    return lib if lib is not None else cbuild.load("linear_bf16w", _declare) if available() else None


def rows() -> int:
    """Rows per step up to which the host's build runs faster than vLLM's float32 GEMM (0 where it does not
    run): more with AVX-512 than with AVX2 alone."""
    lib = _library(None)
    return lib.entropic_bf16w_rows() if lib is not None else 0


def holds_bf16_values(weight: torch.Tensor) -> bool:
    """Whether every element of a float32 tensor is a bfloat16 value (its low 16 bits are zero), so that
    storing it as bfloat16 loses nothing."""
    return weight.dtype == torch.float32 and not bool(torch.any(weight.contiguous().view(torch.int32) & 0xFFFF))


def pack(weight: torch.Tensor, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """weight [N, K] as bfloat16, in the kernel's panels: [ceil(N / P), K, P] for the library's panel width P
    (columns past N zero); None where the kernel does not run. Exact for a float32 weight only where
    ``holds_bf16_values``. ``lib``: a build of the kernel other than the host's (tests; ``load``)."""
    lib = _library(lib)
    if lib is None or weight.dim() != 2:
        return None
    n, k = weight.shape
    width = _panel[lib]
    rows = weight.detach().to(torch.bfloat16).contiguous()
    packed = torch.empty(-(-n // width), k, width, dtype=torch.bfloat16)
    lib.entropic_pack_bf16w(rows.data_ptr(), n, k, packed.data_ptr())
    return packed


def load(path: str) -> ctypes.CDLL:
    """A build of the kernel from ``kernels.cbuild.build_for``, for ``pack`` and ``linear_bf16w``."""
    lib = ctypes.CDLL(path)
    _declare(lib)
    return lib


def linear_bf16w(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None, out: torch.Tensor,
                 lib: ctypes.CDLL | None = None) -> bool:
    """out = x @ weight.T (+ bias), in float32, with ``packed`` = ``pack(weight)`` of a weight [n, K]. x [M, K]
    float32 with unit stride in K; bias [n] float32 or None; out [M, n] float32 with unit stride in n. Returns
    False (nothing written) where it does not run."""
    lib = _library(lib)
    if lib is None:
        return False
    width = _panel[lib]
    if (x.dtype != torch.float32 or out.dtype != torch.float32 or packed.dtype != torch.bfloat16
            or x.dim() != 2 or out.dim() != 2 or x.stride(1) != 1 or out.stride(1) != 1
            or packed.dim() != 3 or not packed.is_contiguous() or packed.shape[1:] != (x.shape[1], width)
            or packed.shape[0] != -(-n // width) or out.shape != (x.shape[0], n)
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return False
    lib.entropic_linear_bf16w(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.data_ptr(), n,
                              None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                              torch.get_num_threads())
    return True
