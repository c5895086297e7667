"""The GPU check (loadtest/gpu_check.py) runs end to end at toy shapes under Triton's interpreter, so it
cannot rot between the sessions that have a GPU: every correctness check passes, every speed section
produces rows. vLLM's attention kernel is loaded the way the GPU machine loads it (its two source files
copied out of the installed vLLM, the rest of vLLM shimmed), which the check names in its result."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_runs_at_toy_shapes_under_the_interpreter(tmp_path):
    import vllm.v1.attention.ops as ops

    vendored = tmp_path / "vllm-ops"
    vendored.mkdir()
    for name in ("triton_unified_attention", "triton_attention_helpers"):
        shutil.copy(Path(ops.__file__).parent / f"{name}.py", vendored)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "gpu-kernels"
    result = subprocess.run([sys.executable, "-m", "loadtest.gpu_check", "--tiny", "--vllm-ops", str(vendored),
                             "--out", str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(out.with_suffix(".json").read_text())
    assert not report.get("errors"), report["errors"]
    assert "shimmed" in report["machine"]["vllm_kernel"]
    checks = {r["check"] for r in report["correctness"]}
    assert {"entropy exact", "entropy tail", "key summaries (max | min)", "top-K kept blocks (rows that differ)",
            "pruned decode, ours", "pruned decode, vLLM unified_attention"} <= checks
    assert all(r["ok"] for r in report["correctness"])
    assert report["attention"] and all("keep1/8_select+vllm_ms" in r for r in report["attention"])
    assert report["entropy"] and report["entropy_sweep"]
    assert "## Decode attention" in out.with_suffix(".md").read_text()
