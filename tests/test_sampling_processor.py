"""The logits processor's bookkeeping with vLLM's real BatchUpdate/SamplingParams classes.

No engine here: batches are built the way vLLM's input batch builds them, and logits are
synthetic rows with known entropies. The engine-level behaviour is covered end to end in
test_http_api.py.
"""
import math

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from kernels.entropy import exact_entropy
from workers.control_params import EXTRA_ARGS_KEY, SamplingControl
from workers.sampling import EntropicLogitsProcessor

VOCAB = 64


def params(key: str, temperature: float = 1.0, **control) -> SamplingParams:
    args = SamplingControl(**control).request_args(key, temperature)
    return SamplingParams(temperature=1.0 if temperature > 0 else 0.0, extra_args=args.into(None))


def update(added=(), removed=(), moved=()) -> BatchUpdate:
    return BatchUpdate(batch_size=8, removed=list(removed), added=list(added), moved=list(moved))


def flat_logits(rows: int) -> torch.Tensor:
    return torch.zeros(rows, VOCAB)  # uniform: entropy log(VOCAB) at any temperature


def test_control_row_is_scaled_and_temperature_follows_the_law():
    lp = EntropicLogitsProcessor(None, torch.device("cpu"), False)
    out_ids: list[int] = []
    lp.update_state(update(added=[(0, params("a", 1.0, target_entropy=2.0, eta=0.5, max_log_step=10), None, out_ids)]))
    logits = torch.randn(1, VOCAB)
    expected_h = float(exact_entropy(logits)[0])
    lp.apply(logits.clone())
    (h, t), = lp.records("a")
    assert h == pytest.approx(expected_h, abs=1e-5) and t == 1.0
    out_ids.append(5)
    z = torch.randn(1, VOCAB)
    result = lp.apply(z.clone())
    t_expected = math.exp(-0.5 * (expected_h - 2.0))
    assert lp.records("a")[1][1] == pytest.approx(t_expected)
    assert torch.allclose(result, z / t_expected)


def test_by_default_the_law_cools_uncertain_rows_and_never_heats_confident_ones():
    lp = EntropicLogitsProcessor(None, torch.device("cpu"), False)
    ids = {"hot": [], "cold": []}
    lp.update_state(update(added=[(0, params("hot", 0.7, target_entropy=2.0), None, ids["hot"]),
                                  (1, params("cold", 0.7, target_entropy=2.0), None, ids["cold"])]))
    for _ in range(5):
        logits = flat_logits(2)  # row 0: uniform, log(64) = 4.2 nats > H*
        logits[1, 0] = 50.0      # row 1: confident, ~0 nats < H*
        lp.apply(logits)
        for v in ids.values():
            v.append(0)
    hot, cold = [t for _, t in lp.records("hot")], [t for _, t in lp.records("cold")]
    assert hot[0] == cold[0] == 0.7
    assert hot[-1] < 0.7 and cold == [0.7] * 5


def test_rerun_at_the_same_position_overwrites_instead_of_appending():
    lp = EntropicLogitsProcessor(None, torch.device("cpu"), False)
    out_ids: list[int] = []
    lp.update_state(update(added=[(0, params("a"), None, out_ids)]))
    lp.apply(torch.randn(1, VOCAB))
    lp.apply(torch.randn(1, VOCAB))  # a discarded partial-prefill sample: same position
    assert len(lp.records("a")) == 1


def test_greedy_rows_are_untouched_but_measured():
    lp = EntropicLogitsProcessor(None, torch.device("cpu"), False)
    lp.update_state(update(added=[(0, params("g", 0.0), None, [])]))
    z = torch.randn(1, VOCAB)
    assert torch.equal(lp.apply(z.clone()), z)
    (h, t), = lp.records("g")
    assert t == 0.0 and h == pytest.approx(float(exact_entropy(z)[0]), abs=1e-5)


def test_calibration_temperature_enters_every_entropy_reading_but_leaves_greedy_output():
    """Paper §5: entropy is taken of softmax(z / T_cal) for observed rows too, so pruning and
    scheduling see the calibrated entropy; a greedy row's logits stay untouched."""
    lp = EntropicLogitsProcessor(None, torch.device("cpu"), False)
    sampled = SamplingParams(temperature=0.5, extra_args={
        EXTRA_ARGS_KEY: SamplingControl(enabled=False, t_cal=4.0).request_args("s", 0.5).into(None)[EXTRA_ARGS_KEY]})
    lp.update_state(update(added=[(0, params("g", 0.0, t_cal=4.0), None, []), (1, sampled, None, [])]))
    z = torch.randn(2, VOCAB) * 3
    assert torch.equal(lp.apply(z.clone()), z)
    (h_greedy, _), = lp.records("g")
    (h_sampled, _), = lp.records("s")
    assert h_greedy == pytest.approx(float(exact_entropy(z[:1] / 4.0)[0]), abs=1e-5)
    assert h_sampled == pytest.approx(float(exact_entropy(z[1:] / (4.0 * 0.5))[0]), abs=1e-5)


def test_state_follows_the_request_through_moves_swaps_and_preemption():
    lp = EntropicLogitsProcessor(None, torch.device("cpu"), False)
    a_ids, b_ids = [], []
    pa, pb = params("a", target_entropy=1.0, eta=0.5), params("b", target_entropy=5.0, eta=0.5, t_max=2.0)
    lp.update_state(update(added=[(0, pa, None, a_ids), (1, pb, None, b_ids)]))
    lp.apply(flat_logits(2))
    a_ids.append(1), b_ids.append(1)
    lp.update_state(update(moved=[(0, 1, MoveDirectionality.SWAP)]))
    lp.apply(flat_logits(2))
    ta, tb = lp.records("a")[1][1], lp.records("b")[1][1]
    assert ta < 1.0 < tb  # a wants less entropy than log(64), b more
    # preempted (removed), then re-added at another index: the controller state survives
    lp.update_state(update(removed=[1]))
    lp.apply(flat_logits(1))
    a_ids.append(2)
    lp.update_state(update(added=[(3, pa, None, a_ids)]))
    lp.apply(flat_logits(4))
    assert len(lp.records("a")) == 3 and lp.records("a")[2][1] < ta
    lp.forget("a")
    assert lp.records("a") == []


def test_requests_without_our_args_are_ignored():
    lp = EntropicLogitsProcessor(None, torch.device("cpu"), False)
    lp.update_state(update(added=[(0, SamplingParams(temperature=0.7), None, [])]))
    z = torch.randn(1, VOCAB)
    assert torch.equal(lp.apply(z.clone()), z)


def test_stop_mass_is_the_probability_of_the_requests_stop_tokens_in_the_recorded_distribution():
    lp = EntropicLogitsProcessor(None, torch.device("cpu"), False)
    args = SamplingControl(enabled=False).request_args("s", 0.5)
    stopping = SamplingParams(temperature=0.5, stop_token_ids=[3, 7], extra_args=args.into(None))
    stopping.update_from_generation_config({}, eos_token_id=11)  # as vLLM's input processor does
    lp.update_state(update(added=[(0, stopping, None, []), (1, params("n", 1.0), None, [])]))
    logits = torch.randn(2, VOCAB)
    lp.apply(logits.clone())
    expected = torch.softmax(logits[0] / 0.5, -1)[[3, 7, 11]].sum()  # not controlled: its own temperature
    assert lp.stop_prob("s") == pytest.approx(float(expected), rel=1e-5)
    assert lp.stop_prob("n") is None  # no stop token: nothing to read
    assert lp.stop_prob("unknown") is None


def test_the_c_entropy_path_and_the_torch_path_record_and_divide_alike(monkeypatch):
    """A batch with control, tempered-but-observed, greedy and foreign rows (and stop tokens), once through the
    C kernel (kernels.cpu_entropy, the CPU default) and once with it declined."""
    import kernels.cpu_entropy

    def batch(lp):
        stopping = SamplingParams(temperature=0.7, stop_token_ids=[3], extra_args=SamplingControl(
            enabled=False).request_args("observed", 0.7).into(None))
        stopping.update_from_generation_config({}, eos_token_id=11)
        lp.update_state(update(added=[(0, params("control", 1.0, t_cal=1.3), None, []), (1, stopping, None, []),
                                      (3, params("greedy", 0.0), None, [])]))  # row 2 is not ours

    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 3
    kernel, answered = kernels.cpu_entropy.exact_entropy_and_log_norm, []
    monkeypatch.setattr(kernels.cpu_entropy, "exact_entropy_and_log_norm",
                        lambda *a: answered.append(kernel(*a)) or answered[-1])
    runs = []
    for declined in (False, True):
        if declined:
            assert answered and answered[-1] is not None  # the first run took the C path
            monkeypatch.setattr(kernels.cpu_entropy, "exact_entropy_and_log_norm", lambda *a: None)
        lp = EntropicLogitsProcessor(None, torch.device("cpu"), False)
        batch(lp)
        out = lp.apply(logits.clone())
        runs.append((out, {k: lp.records(k) for k in ("control", "observed", "greedy")}, lp.stop_prob("observed")))
    (c_out, c_records, c_stop), (t_out, t_records, t_stop) = runs
    assert torch.allclose(c_out, t_out, rtol=1e-6, atol=1e-6)
    assert torch.equal(c_out[1:], logits[1:])  # only the control row is divided
    for key, records in c_records.items():
        assert [t for _, t in records] == [t for _, t in t_records[key]]
        assert [h for h, _ in records] == pytest.approx([h for h, _ in t_records[key]], abs=1e-5)
    assert c_stop == pytest.approx(t_stop, rel=1e-5) and c_stop is not None
