"""Short headless Locust runs against the real server, closed and open loop: the load test works, counts
tokens from `usage` and writes its report; its summary follows vllm bench serve's definitions."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"


def _locust(server: str, model: str, tmp_path: Path, extra_env: dict, args: list[str]) -> dict:
    env = {**os.environ, "LOCUST_MODEL": model, "LOCUST_MAX_TOKENS": "8", "LOCUST_LONG_CHARS": "5000",
           "LOCUST_REPORT": str(tmp_path / "report"), **extra_env}
    env.pop("LOCUST_SHAPE", None)
    result = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", server,
         "--csv", str(tmp_path / "run"), "--only-summary", *args],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.md").read_text().startswith("# Locust run")
    assert (tmp_path / "report.png").stat().st_size > 0
    return report


def test_closed_loop_streams_every_workload_and_reports_vllm_bench_metrics(server, served_model, tmp_path):
    report = _locust(server, served_model, tmp_path, {"LOCUST_MIX": "chat:1,long:1,free:1,entropic:1"},
                     # the mix is interleaved, so the four users' first requests are one of each workload;
                     # --stop-timeout lets requests under way at the end finish instead of vanishing
                     ["-u", "4", "-r", "4", "-t", "20s", "--stop-timeout", "120"])
    rows = {r["Name"]: r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    summary = report["summary"]
    assert summary["all"]["failed"] == 0, summary["errors"]
    assert summary["all"]["completed"] >= 4
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    for workload, block in summary["by_workload"].items():
        assert block["ttft_ms"]["n"] == block["completed"] > 0, workload
        assert 0 < block["mean_output_tokens"] <= 8  # from usage, within max_tokens
        assert int(rows[f"{workload} ttft"]["Request Count"]) > 0
    # ~5000 characters of prose: over the 1024 tokens below which pruning stays dense
    assert summary["by_workload"]["long"]["mean_prompt_tokens"] > 1024


def test_open_loop_sends_at_the_rate_and_answers_every_request_sent(server, served_model, tmp_path):
    report = _locust(server, served_model, tmp_path,
                     {"LOCUST_RATE": "1", "LOCUST_ARRIVALS": "constant", "LOCUST_MIX": "chat:1"},
                     ["-u", "1", "-r", "1", "-t", "8s"])
    summary = report["summary"]
    # Evenly spaced arrivals at 1/s for 8 s: 7 or 8 requests, however slow the answers
    assert 7 <= summary["all"]["requests"] <= 8
    assert summary["all"]["failed"] == 0 and summary["all"]["completed"] == summary["all"]["requests"]
    assert report["settings"]["mode"] == "open loop, constant arrivals at 1.0/s"


def test_summary_follows_vllm_bench_serve_definitions():
    from loadtest import request_metrics as lf

    a = lf.Outcome("chat", 0.0, ok=True, ttft=0.5, e2e=2.5, itl=[1.0, 1.0], output_tokens=5)
    b = lf.Outcome("chat", 1.0, ok=True, ttft=1.5, e2e=1.5, itl=[], output_tokens=1)  # one token: no TPOT
    c = lf.Outcome("long", 2.0, ok=False, ttft=None, e2e=0.1, error="HTTP 503")
    summary = lf.summarize([a, b, c], duration_s=10.0)
    chat = summary["by_workload"]["chat"]
    assert chat["tpot_ms"] == {"n": 1, "mean": 500.0, "p50": 500.0, "p90": 500.0, "p99": 500.0}  # (2.5-0.5)/(5-1)
    assert chat["itl_ms"]["n"] == 2 and chat["itl_ms"]["mean"] == 1000.0
    assert chat["ttft_ms"]["p50"] == pytest.approx(1000.0)  # numpy's interpolated median of 0.5 s and 1.5 s
    assert summary["all"]["output_throughput"] == 0.6 and summary["all"]["failed"] == 1
    assert summary["errors"] == ["HTTP 503"]
