"""Facts about the machine that change how the engine should be configured, and where our caches live."""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path


def cache_root() -> Path:
    """Where this project keeps what it builds and converts: $ENTROPIC_CACHE, else
    $XDG_CACHE_HOME/entropic-serve, else ~/.cache/entropic-serve (the Makefile's VENV follows the same rule)."""
    base = os.environ.get("ENTROPIC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "entropic-serve")
    return Path(base)


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: without them vLLM's CPU path emulates bf16 math, which is several
    times slower than float32 (measured: docs/results/README.md)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_dtype(requested: str, on_gpu: bool) -> str:
    if requested != "auto" or on_gpu:
        return requested
    return "auto" if cpu_has_native_bf16() else "float32"
