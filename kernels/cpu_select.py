"""The fused CPU block selection (kernels/csrc/block_select.c), built with the system C compiler.

The shared library is compiled once per source version and machine flags into the user cache
(``make install`` builds it ahead of time; otherwise the first pruned step does, in about a
second) and called through ctypes on the tensors' memory. Where no compiler is available the
caller falls back to the torch path (kernels.block_select), which computes the same selection.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.hardware import cache_root, cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "block_select.c"
_lib: ctypes.CDLL | None = None
_failed = False


def _compile_flags() -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-std=c11"]
    if {"avx2", "fma"} <= cpu_flags():  # built where it runs (make install / first use), so the host's ISA is safe
        flags += ["-mavx2", "-mfma"]
    return flags


def library_path() -> Path:
    flags = _compile_flags()
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"block_select-{digest}.so"


def build() -> Path:
    path = library_path()
    if path.exists():
        return path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run([compiler, *_compile_flags(), str(SOURCE), "-o", str(out), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(out, path)  # atomic: concurrent builders (several workers) cannot see half a file
    for stale in path.parent.glob("block_select-*.so"):
        if stale != path:
            stale.unlink(missing_ok=True)
    return path


def load() -> ctypes.CDLL | None:
    """The library, or None (logged once) when it cannot be built here."""
    global _lib, _failed
    if _lib is None and not _failed:
        try:
            lib = ctypes.CDLL(str(build()))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.warning("fused block selection unavailable, using the torch path: %s", detail)
            _failed = True
            return None
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.entropic_select_blocks.argtypes = [p, p, i64, p, p, p, i32, i32, i32, i32, i32, ctypes.c_float,
                                               p, i64, p]
        lib.entropic_select_blocks.restype = i32
        _lib = lib
    return _lib


def select_into_table(q: torch.Tensor, summaries: torch.Tensor, physical: torch.Tensor, bias: torch.Tensor,
                      keep: torch.Tensor, scale: float, table: torch.Tensor, rows: torch.Tensor) -> bool:
    """Score, select and write the kept blocks of each pruned row into ``table`` (vLLM's int32 block table).

    q [P, KVH, G, D] float32; summaries [KVH, NB, 2D] float32; physical [P, W] int64; bias [P, W]
    float32; keep, rows [P] int64; table [R, max_blocks] int32 with contiguous rows. Returns False
    (nothing written) when the library is unavailable or the shapes are outside its limits.
    """
    lib = load()
    if lib is None or table.dtype != torch.int32 or table.stride(1) != 1:
        return False
    expected = ((summaries, torch.float32), (physical, torch.int64), (bias, torch.float32), (keep, torch.int64),
                (rows, torch.int64))
    if any(t.dtype != dtype or not t.is_contiguous() for t, dtype in expected):
        return False
    q = q.contiguous().float()
    rows_n, kv_heads, group, d = q.shape
    status = lib.entropic_select_blocks(
        q.data_ptr(), summaries.data_ptr(), summaries.shape[1], physical.data_ptr(), bias.data_ptr(),
        keep.data_ptr(), rows_n, kv_heads, group, d, physical.shape[1], float(scale), table.data_ptr(),
        table.stride(0), rows.data_ptr())
    return status == 0


if __name__ == "__main__":  # make install builds it ahead of the first pruned step
    print(build())
