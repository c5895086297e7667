"""Admission and preemption follow π on the real engine (default model, vLLM's LLMEngine with our
scheduler class, stepped by hand so every scheduling decision is observable)."""
from __future__ import annotations

import pytest

from workers.tracking import PriorityBoard

MAX_TOKENS = 12
BUDGET = 64  # tokens per step: a prompt longer than this is prefilled in chunks over several steps


@pytest.fixture(scope="module")
def engine(model_dir):
    from workers.engine import configure_process_env

    configure_process_env(2, 1)
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), enforce_eager=True, max_model_len=512, max_num_seqs=2, seed=0, dtype="float32",
        max_num_batched_tokens=BUDGET, enable_chunked_prefill=True,
        scheduler_cls="workers.scheduler.EntropicScheduler", scheduling_policy="priority", disable_log_stats=True))
    scheduler = engine.engine_core.engine_core.scheduler
    scheduler.board = PriorityBoard()
    yield engine, scheduler
    while engine.has_unfinished_requests():
        engine.step()


def _add(engine, keys, prompt: str | None = None, max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    from workers.control_params import SamplingControl

    for key in keys:  # the request contract as served (workers.control_params.EntropicArgs)
        extra = SamplingControl(enabled=False).request_args(key, 0.0).into(None)
        engine.add_request(key, prompt or f"Tell me about the number {key}.", SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra))


def _running(scheduler) -> set[str]:
    return {scheduler._keys[r.request_id] for r in scheduler.running}


def _step(engine, produced: dict[str, int]) -> None:
    """One engine step; ``produced`` holds each request's cumulative output tokens."""
    for out in engine.step():
        produced[out.request_id] = len(out.outputs[0].token_ids)


def _drain(engine) -> dict[str, int]:
    tokens: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = len(out.outputs[0].token_ids)
    return tokens


def test_admission_follows_priority_not_arrival(engine):
    engine, scheduler = engine
    keys = ["adm-0", "adm-1", "adm-2", "adm-3"]
    _add(engine, keys)
    scheduler.board.publish({"adm-0": 0.1, "adm-1": 0.2, "adm-2": 0.3, "adm-3": 0.4})
    engine.step()
    assert _running(scheduler) == {"adm-2", "adm-3"}  # the two latest arrivals, highest π
    assert all(n == MAX_TOKENS for n in _drain(engine).values())


def test_a_clearly_higher_pi_preempts_the_lowest_running(engine):
    engine, scheduler = engine
    scheduler.preempt_margin = 2.0
    _add(engine, ["pre-0", "pre-1", "pre-2"])
    scheduler.board.publish({"pre-0": 0.5, "pre-1": 0.4, "pre-2": 0.3})
    engine.step()
    assert _running(scheduler) == {"pre-0", "pre-1"}
    before = scheduler.priority_preemptions
    scheduler.board.publish({"pre-0": 0.5, "pre-1": 0.4, "pre-2": 0.6})  # higher, but below the margin
    engine.step()
    assert scheduler.priority_preemptions == before and _running(scheduler) == {"pre-0", "pre-1"}
    scheduler.board.publish({"pre-0": 0.5, "pre-1": 0.4, "pre-2": 5.0})
    engine.step()
    assert scheduler.priority_preemptions == before + 1
    assert _running(scheduler) == {"pre-0", "pre-2"}  # pre-1, the lowest π, was preempted
    finished = _drain(engine)
    assert sorted(finished) == ["pre-0", "pre-1", "pre-2"]
    assert all(n == MAX_TOKENS for n in finished.values())  # the preempted request resumed and completed
    scheduler.preempt_margin = None


def test_decode_steps_follow_grants_and_paused_requests_resume_in_place(engine):
    from controller.laws.grants import GrantPolicy
    from workers.tracking import GrantBoard

    engine, scheduler = engine
    grants = GrantBoard(GrantPolicy(slots=1, lease_steps=3))
    scheduler.grants = grants
    produced: dict[str, int] = {}

    try:
        keys = ["grant-hi", "grant-lo"]
        _add(engine, keys)
        _step(engine, produced)  # admission and prefill (grants only pause running requests): one token each
        assert produced == {"grant-hi": 1, "grant-lo": 1}
        pis = {"grant-hi": 2.0, "grant-lo": 1.0}
        scheduler.board.publish(pis)
        grants.renew(pis)
        withheld = scheduler.withheld_steps
        for _ in range(3):  # grant-hi's 3-step lease; grant-lo has none and pauses, still holding its KV
            _step(engine, produced)
            assert _running(scheduler) == set(keys)
        assert produced == {"grant-hi": 4, "grant-lo": 1}
        assert scheduler.withheld_steps == withheld + 3
        _step(engine, produced)  # no lease left anywhere: everyone runs rather than stall
        assert produced == {"grant-hi": 5, "grant-lo": 2}
        pis = {"grant-hi": 1.0, "grant-lo": 2.0}  # the ranking flips: only grant-lo advances
        scheduler.board.publish(pis)
        grants.renew(pis)
        _step(engine, produced)
        assert produced == {"grant-hi": 5, "grant-lo": 3}
        finished = _drain(engine)
        assert finished == {"grant-hi": MAX_TOKENS, "grant-lo": MAX_TOKENS}  # the paused request resumed in place
    finally:
        scheduler.grants = None


def test_a_higher_pi_prompt_in_chunked_prefill_never_starves_decoding_requests(engine):
    """vLLM hands the token budget to running requests in list order; a prompt's chunk asks for all of it.
    Ranked first by π it left the decoding requests out of every step until its prompt was in."""
    engine, scheduler = engine
    _add(engine, ["starve-dec"], "Name a colour.", max_tokens=40)
    produced: dict[str, int] = {}

    _step(engine, produced)
    assert produced == {"starve-dec": 1}
    long_prompt = " ".join(f"item {i}," for i in range(60))  # ~180 tokens: three chunks or more
    assert len(engine.get_tokenizer().encode(long_prompt)) > 2 * BUDGET
    _add(engine, ["starve-pre"], long_prompt, max_tokens=40)
    steps = 0
    while "starve-pre" not in produced:
        # As the replica's control loop does, every so often: admitted, the prompt is running mid-prefill
        scheduler.board.publish({"starve-dec": 0.1, "starve-pre": 50.0})
        before = produced["starve-dec"]
        _step(engine, produced)
        steps += 1
        assert produced["starve-dec"] == before + 1, f"step {steps}: the decoding request was left out"
    assert steps >= 3  # the prompt did take several chunks, each sharing its step with the decode
    _drain(engine)


@pytest.mark.parametrize("target,prefill_s", [
    ({"target_gap_s": 0.2}, 0.5),  # (0.2 - 0.1) / (0.5 - 0.1) = 1/4
    # 1.5 steps of the whole batch (the decoding request and the prompt: 0.2 s) = 0.3 s; (0.3 - 0.1) / (0.9 - 0.1)
    # = 1/4. Counted in the step now (0.1 s), it would be (0.15 - 0.1) / 0.8 = 1/16
    ({"target_decode_steps": 1.5}, 0.9),
], ids=["time", "whole-batch-steps"])
def test_the_prefill_gate_lets_its_share_of_contended_steps_carry_prefill(engine, target, prefill_s):
    """Step times held where the law gives φ = 1/4: while a request decodes, a prompt is admitted and
    prefilled only in every fourth step (vLLM's throttle_prefills in the other three), and the decoding
    request advances in every step."""
    from controller.laws.prefill_gate import PrefillGatePolicy
    from workers.scheduler import PrefillGate

    engine, scheduler = engine
    gate = PrefillGate(PrefillGatePolicy(**target))
    gate.decode_step_s, gate.decode_per_sequence_s, gate.prefill_step_s, gate.WEIGHT = 0.1, 0.1, prefill_s, 0.0
    scheduler.prefill_gate = gate
    produced: dict[str, int] = {}

    try:
        _add(engine, ["gate-dec"], "Name a colour.", max_tokens=40)
        _step(engine, produced)
        # ~180 tokens: three chunks or more; a prompt of each case's own (the prefix cache holds the other's)
        long_prompt = f"Case {prefill_s}. " + " ".join(f"entry {i};" for i in range(60))
        _add(engine, ["gate-pre"], long_prompt, max_tokens=4)
        prompt = next(r for r in scheduler.requests.values() if scheduler._keys.get(r.request_id) == "gate-pre")
        carried = []
        while "gate-pre" not in produced:
            before, computed = produced["gate-dec"], prompt.num_computed_tokens
            _step(engine, produced)
            assert produced["gate-dec"] == before + 1, "the decoding request must advance in every step"
            carried.append(prompt.num_computed_tokens > computed)
        chunks = sum(carried)
        assert chunks >= 3 and carried == [False, False, False, True] * chunks, carried
        assert gate.deferred_steps == 3 * chunks
        assert _drain(engine) == {"gate-dec": 40, "gate-pre": 4}
    finally:
        scheduler.prefill_gate = None


def test_an_untimed_prefill_gate_defers_nothing_and_times_both_kinds_of_step(engine):
    from controller.laws.prefill_gate import PrefillGatePolicy
    from workers.scheduler import PrefillGate

    engine, scheduler = engine
    gate = PrefillGate(PrefillGatePolicy(target_gap_s=1e-6))  # a target no step meets
    scheduler.prefill_gate = gate
    try:
        _add(engine, ["timed-dec"], "Name a shape.", max_tokens=8)
        engine.step()
        _add(engine, ["timed-pre"], " ".join(f"row {i}:" for i in range(60)), max_tokens=4)
        assert _drain(engine) == {"timed-dec": 8, "timed-pre": 4}
        # decode-only steps miss the target on their own: deferring could not reach it, so nothing was
        assert gate.deferred_steps == 0
        assert None not in (gate.decode_step_s, gate.decode_per_sequence_s, gate.prefill_step_s)
        assert 0 < gate.decode_per_sequence_s <= gate.decode_step_s and 0 < gate.prefill_step_s
    finally:
        scheduler.prefill_gate = None
