"""loadtest/bench_cpu_kernels.py on a small step: both kernels run on the inputs it builds, agree (the tool
checks), and each configuration gets a row per thread count."""
from __future__ import annotations

import pytest

from loadtest.bench_cpu_kernels import main


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_kernel_benchmark_times_both_kernels_on_the_same_attention(tmp_path, dtype, vllm_cpu_ops):
    import torch

    from kernels.cpu_decode_attention import available

    if not available(getattr(torch, dtype)):
        pytest.skip(f"our decode kernel does not run on a {dtype} cache on this CPU")
    out = tmp_path / "kernels"
    assert main(["--contexts", "700", "--threads", "1", "2", "--layers", "2", "--rows", "3", "--rounds", "2",
                 "--steps", "1", "--dtype", dtype, "--out", str(out)]) == 0
    text = (tmp_path / "kernels.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 700 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2"]
    assert all(row.split("|")[3].strip() == "3 / 11" for row in rows)  # a quarter of 11 blocks, rounded
