"""Our plain-C CPU kernels (kernels/csrc), built with the system C compiler and loaded through ctypes.

Each shared library is compiled once per source version and machine flags into the user cache
(``make install`` builds them ahead of time; otherwise the first call does, in about a second). Where
no compiler is available ``load`` answers None, logged once per library, and the callers use their
torch paths, which compute the same results.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from kernels.hardware import cache_root, cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
_loaded: dict[str, ctypes.CDLL | None] = {}


# Libraries that spread their work over the engine's OpenMP threads; the others run on the calling thread
OPENMP = frozenset({"decode_attention", "block_select", "block_summary", "linear_bf16w"})
# Libraries written for AVX-512 where the CPU has it (the others are AVX2 code, and a compiler free to widen them
# would change their measured speed, not their results)
AVX512 = frozenset({"linear_bf16w"})


# Every build a library can have: its compiler flags, and the CPU flags a host needs to run it (narrowest first)
ISAS = {"scalar": ([], frozenset()), "avx2": (["-mavx2", "-mfma"], frozenset({"avx2", "fma"})),
        "avx512": (["-mavx2", "-mfma", "-mavx512f"], frozenset({"avx2", "fma", "avx512f"}))}


def runnable_isas(name: str) -> dict[str, list[str]]:
    """The builds of a library this host can run, by name (AVX-512 only for the libraries written for it)."""
    return {isa: flags for isa, (flags, needs) in ISAS.items()
            if needs <= cpu_flags() and (isa != "avx512" or name in AVX512)}


def isa_flags(name: str) -> list[str]:
    """The instruction sets a library is built for: the host's (it is built where it runs, by make install or its
    first use)."""
    flags = []
    if {"avx2", "fma"} <= cpu_flags():
        flags += ["-mavx2", "-mfma"]
        if name in AVX512 and "avx512f" in cpu_flags():
            flags.append("-mavx512f")
    return flags


def _compile_flags(name: str, openmp: bool = True, isa: list[str] | None = None) -> list[str]:
    flags = ["-O3", "-shared", "-fPIC", "-std=c11", *(isa_flags(name) if isa is None else isa)]
    if openmp and name in OPENMP:
        flags.append("-fopenmp")
    return flags


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    return compiler


def build_for(name: str, isa: list[str], directory: Path) -> Path:
    """kernels/csrc/<name>.c built for the instruction sets ``isa`` (a subset of ``isa_flags``) into
    ``directory``: the tests run each code path a library has that the host can execute, not only the one it
    serves with."""
    out = directory / f"{name}-{'_'.join(f.lstrip('-m') for f in isa) or 'scalar'}.so"
    subprocess.run([_compiler(), str(CSRC / f"{name}.c"), "-o", str(out), "-lm", *_compile_flags(name, isa=isa)],
                   check=True, capture_output=True, text=True)
    return out


def library_path(name: str) -> Path:
    flags = _compile_flags(name)
    # the headers too (all of them: a few hundred lines), so an edit to one rebuilds every library
    sources = [CSRC / f"{name}.c", *sorted(CSRC.glob("*.h"))]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(flags).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"{name}-{digest}.so"


def build(name: str) -> Path:
    """kernels/csrc/<name>.c as a shared library in the cache (built if missing); older builds removed."""
    path = library_path(name)
    if path.exists():
        return path
    compiler = _compiler()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        command = [compiler, str(CSRC / f"{name}.c"), "-o", str(out), "-lm"]
        try:
            subprocess.run([*command, *_compile_flags(name)], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError:
            if name not in OPENMP:
                raise
            # a compiler without OpenMP: a serial build, on the calling thread (decode_attention's says so, and
            # its caller then leaves steps on several threads to vLLM's kernel)
            subprocess.run([*command, *_compile_flags(name, openmp=False)], check=True, capture_output=True,
                           text=True)
        os.replace(out, path)  # atomic: concurrent builders (several workers) cannot see half a file
    for stale in path.parent.glob(f"{name}-*.so"):
        if stale != path:
            stale.unlink(missing_ok=True)
    return path


def load(name: str, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The library of kernels/csrc/<name>.c with its functions' signatures set by ``declare``, or None
    (logged once) when it cannot be built here."""
    if name not in _loaded:
        try:
            lib = ctypes.CDLL(str(build(name)))
            declare(lib)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.warning("C kernel %s unavailable, using the torch path: %s", name, detail)
            lib = None
        _loaded[name] = lib
    return _loaded[name]


if __name__ == "__main__":  # make install builds them ahead of the first call
    for source in sorted(CSRC.glob("*.c")):
        print(build(source.stem))
