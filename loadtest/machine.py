"""Describe the machine a benchmark ran on (so published figures say where they come from)."""
from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Mapping

THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


def cpu_generation(cpuinfo: str) -> str:
    """The CPU's family and model numbers from /proc/cpuinfo's text: one model name ("AMD EPYC") covers
    generations that differ in speed on the same flags (family 25 is Zen 3/4, 26 is Zen 5)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break  # the first processor's block is enough
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"family {fields['cpu family']} model {fields['model']}"


def memory_pages(thp_enabled: str, environ: Mapping[str, str]) -> str:
    """Whether this process's large allocations can sit on huge pages: the kernel's transparent-huge-page mode
    (the bracketed word of ``THP_SYSFS``) and torch's ``THP_MEM_ALLOC_ENABLE``, with which torch asks for them
    where the mode is ``madvise``. Attention over a paged KV cache reads scattered blocks, so the two move its
    speed on some CPUs (docs/results/, the huge-pages rows); a result that does not say them cannot be rerun
    as it ran."""
    mode = re.search(r"\[(\w+)\]", thp_enabled)
    return (f"transparent huge pages {mode.group(1) if mode else 'not recorded'}, "
            f"THP_MEM_ALLOC_ENABLE {environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")


def describe() -> dict[str, str | int]:
    cpu = platform.processor() or ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            generation = cpu_generation(f.read())
    except OSError:
        generation = ""
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = 0
    try:
        with open(THP_SYSFS) as f:
            thp_enabled = f.read()
    except OSError:
        thp_enabled = ""
    import torch
    import vllm

    from kernels.hardware import cpu_flags, resolve_dtype

    # The flags that choose the engine's dtype and our kernels (kernels.hardware, kernels.cbuild).
    isa = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"})
    dtype = resolve_dtype("auto", False)
    return {"cpu": cpu, "cpu_generation": generation or "not recorded", "cpu_flags": " ".join(isa) or "none",
            "cpu_dtype_auto": "the model's dtype (this CPU has native bf16)" if dtype == "auto" else dtype,
            "cores": os.cpu_count() or 0, "memory_gib": mem_gib, "memory_pages": memory_pages(thp_enabled, os.environ),
            "python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}


def publish(module: str, argv: list[str] | None, out: str, fields: dict, render) -> dict:
    """Stamp a benchmark result with its command, date and machine; write <out>.json and <out>.md."""
    import json
    import shlex
    import sys
    from datetime import datetime, timezone
    from pathlib import Path

    # Quoted, so the line reruns as printed (an argument may hold spaces: bench-serve's --vllm-args)
    result = {"command": f"python -m {module} " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": describe(), **fields}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Appended, not with_suffix: a name like "rate0.45" has no suffix to replace
    path.with_name(path.name + ".json").write_text(json.dumps(result, indent=2))
    text = render(result)
    path.with_name(path.name + ".md").write_text(text)
    print(text)
    return result


def header(result: dict, title: str, engine: str) -> list[str]:
    """A result file's first lines: its title and date, the command, the machine and ``engine`` (how it ran)."""
    m = result["machine"]
    return [f"# {title} ({result['date']})", "", f"Command: `{result['command']}`", "",
            f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, vllm {m['vllm']}; "
            f"{engine}.", ""]


def cpu_text(machine: dict) -> str:
    """The CPU as a result file names it: model, family and model numbers, the flags that chose dtype and
    kernels, and (where recorded) the memory pages its allocations could use."""
    generation = machine.get("cpu_generation", "not recorded")
    pages = f"; {machine['memory_pages']}" if "memory_pages" in machine else ""
    return f"{machine['cpu']}, {generation} (CPU flags: {machine.get('cpu_flags', 'not recorded')}{pages})"
