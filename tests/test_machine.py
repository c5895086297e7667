"""loadtest.machine: what a result file records about the CPU it ran on."""
from __future__ import annotations

from loadtest.machine import cpu_generation, cpu_text, memory_pages

# Two processors' blocks as /proc/cpuinfo lists them on a 2-core AMD EPYC (Zen 5), trimmed
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx2 avx512f avx512_bf16

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
"""


def test_generation_is_the_first_processors_family_and_model():
    assert cpu_generation(CPUINFO) == "family 26 model 2"


def test_generation_missing_fields_give_nothing():
    # e.g. an ARM host, whose /proc/cpuinfo names neither
    assert cpu_generation("processor\t: 0\nBogoMIPS\t: 50.00\n") == ""
    assert cpu_generation("") == ""


def test_cpu_text_names_the_generation_and_keeps_older_results_readable():
    assert cpu_text({"cpu": "AMD EPYC", "cpu_generation": "family 26 model 2", "cpu_flags": "avx2"}) == \
        "AMD EPYC, family 26 model 2 (CPU flags: avx2)"
    # result files written before the field existed
    assert cpu_text({"cpu": "AMD EPYC", "cpu_flags": "avx2"}) == "AMD EPYC, not recorded (CPU flags: avx2)"


def test_memory_pages_name_the_kernels_mode_and_torchs_request():
    # the sysfs file as the kernel writes it: the mode in force bracketed
    assert memory_pages("always [madvise] never\n", {"THP_MEM_ALLOC_ENABLE": "1"}) == \
        "transparent huge pages madvise, THP_MEM_ALLOC_ENABLE 1"
    assert memory_pages("[always] madvise never\n", {}) == "transparent huge pages always, THP_MEM_ALLOC_ENABLE unset"
    # no such file (not Linux, or a kernel without THP)
    assert memory_pages("", {}) == "transparent huge pages not recorded, THP_MEM_ALLOC_ENABLE unset"


def test_cpu_text_adds_the_memory_pages_where_recorded():
    machine = {"cpu": "Intel Xeon", "cpu_generation": "family 6 model 207", "cpu_flags": "avx2 avx512f",
               "memory_pages": "transparent huge pages madvise, THP_MEM_ALLOC_ENABLE unset"}
    assert cpu_text(machine) == ("Intel Xeon, family 6 model 207 (CPU flags: avx2 avx512f; transparent huge pages "
                                 "madvise, THP_MEM_ALLOC_ENABLE unset)")
