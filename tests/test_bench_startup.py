"""loadtest/bench_startup.py's bookkeeping (the benchmark itself starts servers for minutes)."""
from pathlib import Path

import pytest

from loadtest.bench_startup import cache_env, check_caches_written, summarize


def _cell(server: str, cache: str, round_: int, healthy: float, answer: float) -> dict:
    return {"pair": "defaults", "server": server, "cache": cache, "round": round_,
            "healthy_s": healthy, "first_answer_s": answer}


def test_ratios_pair_the_servers_within_each_round_and_cache_state():
    cells = [_cell("vllm", "cold", 0, 200, 210), _cell("vllm", "warm", 0, 100, 104),
             _cell("ours", "cold", 0, 150, 151), _cell("ours", "warm", 0, 50, 52),
             _cell("ours", "cold", 1, 180, 181), _cell("ours", "warm", 1, 60, 61),
             _cell("vllm", "cold", 1, 120, 130), _cell("vllm", "warm", 1, 80, 90)]
    summary = summarize(cells)
    assert list(summary) == ["defaults/cold", "defaults/warm"]
    assert summary["defaults/cold"]["healthy_s"]["ratios"] == [0.75, 1.5]
    assert summary["defaults/cold"]["healthy_s"]["median_ratio"] == pytest.approx(1.125)
    assert summary["defaults/warm"]["first_answer_s"]["ratios"] == [0.5, pytest.approx(61 / 90)]
    assert summary["defaults/warm"]["healthy_s"]["ours"] == [50, 60]


def test_a_round_missing_one_server_gives_no_ratio():
    summary = summarize([_cell("ours", "cold", 0, 150, 151)])
    healthy = summary["defaults/cold"]["healthy_s"]
    assert healthy["ratios"] == [] and healthy["median_ratio"] is None


def test_a_cold_start_that_left_its_caches_empty_is_refused(tmp_path):
    env = cache_env(tmp_path / "caches")
    for path in env.values():
        Path(path, "modelinfos").mkdir(parents=True)  # what vLLM writes before it compiles anything
    with pytest.raises(RuntimeError, match="left no compiled kernel"):
        check_caches_written(env, "ours")
    (Path(env["VLLM_CACHE_ROOT"]) / "modelinfos" / "kernel.so").write_bytes(b"\0")  # one directory is enough
    check_caches_written(env, "ours")
