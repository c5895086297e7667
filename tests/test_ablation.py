"""The Table 1 harness (loadtest/ablation.py): its paired, seeded summary on synthetic runs, its workload
draw, and one tiny real run end to end (the baseline, four requests, at seed 1: the seed loop and the pairing
across seeds are the summary's, tested on synthetic runs above; a second real seed would only start a second
engine)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.ablation import ABSOLUTE, NORMALIZED, summarize
from loadtest.workload import drawn_jobs

ROOT = Path(__file__).resolve().parent.parent


def _row(seed: int, correct: list[float], throughput: float) -> dict:
    run_level = {k: 1.0 for k, _ in NORMALIZED} | {"throughput_tok_s": throughput, "kv_blocks_kept_ratio": 1.0}
    per_request = {f"checkable-{i}": {"exact_accuracy": c, "latency_per_token_s": 0.1, "agreement": 1.0}
                   for i, c in enumerate(correct)}
    return {"seed": seed, **run_level, "per_request": per_request}


def test_summary_pairs_each_configuration_with_the_baseline_and_says_what_is_not_significant():
    # baseline right on half the questions; "better" right on all of them, same seeds, same questions;
    # "same" identical to the baseline; throughput 10% higher for "better" in every seed
    runs = {seed: {"baseline": _row(seed, [1.0, 0.0] * 20, 100.0), "same": _row(seed, [1.0, 0.0] * 20, 100.0),
                   "better": _row(seed, [1.0] * 40, 110.0)} for seed in range(5)}
    summary = summarize(runs)
    better = summary["difference"]["better"]["exact_accuracy"]
    assert better[0] == 0.5 and better[1] > 0  # 200 paired questions: the gain is significant
    same = summary["difference"]["same"]["exact_accuracy"]
    assert same[1] <= 0 <= same[2]
    ratio, low, high = summary["normalized"]["better"]["throughput_tok_s"]
    assert abs(ratio - 1.1) < 1e-9 and low > 1  # per seed, paired: 1.1 in every one
    assert summary["absolute"]["baseline"]["exact_accuracy"][0] == 0.5
    assert set(summary["absolute"]["baseline"]) == {k for k, _ in ABSOLUTE}


def test_workload_draws_keep_the_proportions_and_differ_by_seed():
    jobs = drawn_jobs(100, seed=3, passkey_tokens=(1100,), free_tokens=8)
    kinds = [j.kind for j in jobs]
    assert (kinds.count("checkable"), kinds.count("passkey"), kinds.count("free_form")) == (50, 25, 25)
    assert len({j.name for j in jobs}) == 100
    assert [j.prompt for j in jobs] == [j.prompt for j in drawn_jobs(100, seed=3, passkey_tokens=(1100,), free_tokens=8)]
    assert [j.prompt for j in jobs] != [j.prompt for j in drawn_jobs(100, seed=4, passkey_tokens=(1100,), free_tokens=8)]


def test_a_tiny_real_run_at_a_chosen_seed_writes_its_tables(tmp_path, model_dir):
    out = tmp_path / "ablation"
    subprocess.run([sys.executable, "-m", "loadtest.ablation", "--seeds", "1", "--seed", "1", "--requests", "4",
                    "--configs", "baseline", "--free-tokens", "4", "--passkey-tokens", "1100", "--threads", "1",
                    "--eager", "--kv-gib", "1", "--out", str(out)],  # eager and 1 GiB: the quickest engine start
                   check=True, cwd=ROOT, capture_output=True, timeout=600)
    result = json.loads((tmp_path / "ablation.json").read_text())
    assert list(result["runs"]) == ["1"] and result["settings"]["seeds"] == 1 and result["settings"]["seed"] == 1
    assert all(len(r["baseline"]["per_request"]) == 4 for r in result["runs"].values())
    text = (tmp_path / "ablation.md").read_text()
    assert "1 seed(s) x 4 requests" in text and "| baseline | " in text
