"""loadtest/bench_cpu_linear.py on one decoder layer of the default model and its LM head: vLLM's GEMM and every
build of our kernel the CPU runs give the same products (the tool checks) and get a row per rows and threads."""
from __future__ import annotations

import pytest

from kernels import cpu_linear
from kernels.hardware import cpu_flags
from loadtest.bench_cpu_linear import layer_shapes, main
from workers.model_store import default_model_dir


def test_the_step_is_the_default_models_linear_layers():
    shapes = layer_shapes(default_model_dir(), None)
    assert len(shapes) == 4 * 30 + 1 and shapes[:4] == [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    assert shapes[-1] == (49152, 576)  # the tied LM head


@pytest.mark.skipif(not cpu_linear.available(), reason="the kernel needs AVX2 and FMA and a C compiler")
def test_the_benchmark_times_vllms_gemm_and_each_build_on_the_same_products(tmp_path, vllm_cpu_ops):
    out = tmp_path / "linear"
    assert main(["--layers", "1", "--rows", "1", "5", "--threads", "1", "2", "--rounds", "2", "--steps", "1",
                 "--out", str(out)]) == 0
    text = (tmp_path / "linear.md").read_text()
    builds = ["avx2"] + (["avx512"] if "avx512f" in cpu_flags() else [])
    assert all(f"ours, {b} build" in text for b in builds)
    rows = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 5 |")]
    assert [(r.strip(), t.strip()) for r, t in rows] == [("1", "1"), ("1", "2"), ("5", "1"), ("5", "2")]
    assert f"up to {cpu_linear.rows()} rows" in text
