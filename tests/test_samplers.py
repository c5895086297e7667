"""The comparison samplers of loadtest/samplers.py (dynamic temperature, mirostat v2, the entropy recorder) and
bench_samplers' text metrics, on inputs whose answers are known."""
import math

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from loadtest.bench_samplers import bleu4, plot, sampler_args, self_bleu, trajectory
from loadtest.samplers import (
    KEY,
    DynamicTemperature,
    EntropyRecorder,
    Mirostat2,
    dynamic_temperature,
    mirostat_mask,
    typical_mask,
)


def added(index, temperature, extra, output_ids):
    return BatchUpdate(batch_size=4, removed=[], moved=[],
                       added=[(index, SamplingParams(temperature=temperature, extra_args=extra), None, output_ids)])


def test_dynamic_temperature_spans_its_range_with_the_normalized_entropy():
    uniform, peaked = torch.zeros(1, 100), torch.tensor([[50.0] + [0.0] * 99])
    assert float(dynamic_temperature(uniform, 1.0, 0.5, 1.0)[0]) == pytest.approx(1.5)
    assert float(dynamic_temperature(peaked, 1.0, 0.5, 1.0)[0]) == pytest.approx(0.5, abs=1e-3)
    half = torch.cat([torch.zeros(1, 50), torch.full((1, 50), float("-inf"))], -1)  # 50 of 100 finite: H/log V = 1
    assert float(dynamic_temperature(half, 1.0, 0.5, 1.0)[0]) == pytest.approx(1.5)


def test_the_dynamic_temperature_processor_divides_each_row_by_its_own_temperature():
    lp = DynamicTemperature(None, torch.device("cpu"), False)
    lp.update_state(added(0, 1.0, {KEY: "a", "dynatemp_t": 0.8, "dynatemp_range": 0.4}, []))
    logits = torch.randn(2, 64)
    expected = logits[0] / dynamic_temperature(logits[:1], 0.8, 0.4, 1.0)[0]
    out = lp.apply(logits.clone())
    assert torch.allclose(out[0], expected) and torch.equal(out[1], logits[1])  # row 1 is not its request


def test_mirostat_masks_what_is_more_surprising_than_mu_but_never_the_top_token():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    assert mirostat_mask(logits, 1.5).tolist() == [False, True, True, True]  # surprises 1, 2, 3, 3 bits
    assert mirostat_mask(logits, 2.5).tolist() == [False, False, True, True]
    assert mirostat_mask(logits, 0.1).tolist() == [False, True, True, True]


def test_typical_sampling_keeps_the_tokens_whose_surprisal_is_nearest_the_entropy_until_the_mass():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])  # surprisals 0.69, 1.39, 2.08, 2.08 nats; H = 1.21
    logits = torch.log(probs)
    assert typical_mask(logits, 0.2).tolist() == [True, False, True, True]  # 1.39 is nearest H, 0.25 >= 0.2
    assert typical_mask(logits, 0.6).tolist() == [False, False, True, True]  # then 0.69 (|0.52| < |0.87|)
    assert typical_mask(logits, 1.0).tolist() == [False, False, False, False]
    with_masked = torch.cat([logits, torch.tensor([float("-inf")])])
    assert typical_mask(with_masked, 1.0).tolist()[-1] is True


def test_mirostat_moves_mu_by_eta_times_the_sampled_tokens_surprise_error():
    Mirostat2.state.clear()
    lp = Mirostat2(None, torch.device("cpu"), False)
    out_ids: list[int] = []
    tau, eta = 3.0, 0.5
    lp.update_state(added(0, 1.0, {KEY: "m", "mirostat_tau": tau, "mirostat_eta": eta}, out_ids))
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]))
    first = lp.apply(logits.clone())
    assert Mirostat2.state["m"][0] == 2 * tau  # mu starts at 2 tau: surprises up to 4 bits kept, nothing masked
    assert torch.isfinite(first).all()
    out_ids.append(1)  # the engine sampled token 1: 2 bits of surprise
    lp.apply(logits.clone())
    assert Mirostat2.state["m"][0] == pytest.approx(2 * tau - eta * (2.0 - tau))
    lp.apply(logits.clone())  # the same position again (a re-run step): mu stays
    assert Mirostat2.state["m"][0] == pytest.approx(2 * tau - eta * (2.0 - tau))


def test_the_recorder_measures_the_distribution_at_the_requests_temperature():
    EntropyRecorder.records.clear()
    lp = EntropyRecorder(None, torch.device("cpu"), False)
    out_ids: list[int] = []
    lp.update_state(added(0, 0.5, {KEY: "r"}, out_ids))
    logits = torch.randn(1, 32)
    lp.apply(logits.clone())
    p = torch.softmax(logits[0] / 0.5, -1)
    assert EntropyRecorder.records["r"] == [pytest.approx(float(-(p * p.log()).sum()), abs=1e-5)]
    out_ids.append(3)
    lp.apply(torch.zeros(1, 32))
    assert EntropyRecorder.records["r"][1] == pytest.approx(math.log(32), abs=1e-5)


def test_bleu_is_one_for_a_copy_and_self_bleu_rises_as_samples_agree():
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    assert bleu4(a, [a]) == pytest.approx(1.0)
    assert bleu4(a, [[9, 10, 11, 12, 13, 14, 15, 16]]) < 0.1
    assert self_bleu([a, a, a]) > self_bleu([a, [8, 7, 6, 5, 4, 3, 2, 1], [2, 4, 6, 8, 1, 3, 5, 7]])


def test_each_sampler_asks_the_engine_for_its_own_knob():
    assert sampler_args("fixed", 0.7, "k") == (0.7, {KEY: "k"})
    t, extra = sampler_args("mirostat", 5.0, "k")
    assert t == 1.0 and extra["mirostat_tau"] == 5.0
    t, extra = sampler_args("ours", 2.5, "k")
    assert t == 1.0 and extra["entropic"]["target_entropy"] == 2.5 and extra["entropic"]["control"]
    with pytest.raises(ValueError):
        sampler_args("nope", 1.0, "k")


def test_the_trajectory_averages_each_position_over_the_outputs_that_reached_it():
    series = [[1.0, 2.0, 3.0, 9.0], [3.0, 4.0, float("nan")], [2.0, 3.0, 5.0], [2.0]]
    got = trajectory(series)
    assert got["mean"] == pytest.approx([2.0, 3.0, 4.0])  # position 3: one output of four reached it
    assert got["sd"][0] == pytest.approx(math.sqrt(2 / 3)) and got["sd"][2] == pytest.approx(math.sqrt(2))


def test_entropy_trajectories_are_drawn_per_sampler(tmp_path):
    rows = {name: {"entropy_trajectory": {"mean": [1.0, 1.2], "sd": [0.1, 0.2]}, "first_output_entropy": [0.9, 1.4]}
            for name in ("fixed", "ours")}
    paths = plot({"samplers": rows, "target": 1.1}, tmp_path / "samplers")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["samplers-entropy.png", "samplers-entropy-one-output.png"]
    assert all(open(p, "rb").read(4) == b"\x89PNG" for p in paths)


def test_a_tiny_comparison_runs_end_to_end_and_draws_its_trajectories(tmp_path, model_dir):
    """The harness on the default model at the smallest size that exercises every step (tuning, evaluation,
    perplexity, plots), so it does not rot between the runs published in docs/results."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "samplers"
    subprocess.run([sys.executable, "-m", "loadtest.bench_samplers", "--target", "1.0", "--samples", "1", "--seeds",
                    "1", "--max-tokens", "6", "--tune-samples", "1", "--bisect-steps", "1", "--threads", "1",
                    "--batch", "8", "--kv-gib", "1", "--out", str(out)],
                   check=True, cwd=Path(__file__).resolve().parents[1], capture_output=True, timeout=600)
    result = json.loads((tmp_path / "samplers.json").read_text())
    assert list(result["samplers"]) == ["fixed", "dynatemp", "mirostat", "ours"]
    for row in result["samplers"].values():
        assert 1 <= len(row["entropy_trajectory"]["mean"]) <= 6 and len(row["first_output_entropy"]) <= 6
    assert all(Path(p).exists() for p in result["plots"])
    assert "samplers-entropy.png" in (tmp_path / "samplers.md").read_text()
