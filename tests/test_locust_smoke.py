"""A short headless Locust run against the real server: the load test itself works."""
import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_locust_streams_and_reports_sse_metrics(server, served_model, tmp_path):
    env = {**os.environ, "LOCUST_MODEL": served_model, "LOCUST_MAX_TOKENS": "8"}
    env.pop("LOCUST_SHAPE", None)
    result = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
         "-u", "2", "-r", "2", "-t", "12s", "--host", server, "--csv", str(tmp_path / "run"), "--only-summary"],
        env=env, capture_output=True, text=True, timeout=180)
    rows = {r["Name"]: r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("chat ttft", "chat itl", "chat e2e"):
        assert int(rows[name]["Request Count"]) > 0, rows.keys()
    assert int(rows["Aggregated"]["Failure Count"]) == 0
