"""EPIC through the replica core (workers.epic): the real engine, the default model.

At α = 0 an EPIC draw is the model's own next-token distribution over its ``max_candidates`` most likely
tokens (top-k sampling): checked against the distribution the engine reports for the prefix (chi-square). At α ≠ 0
the draws match q_α computed exhaustively over the candidates (chi-square, at a horizon of one token, where the
lookahead estimate is exact) while fewer candidates are evaluated than an exhaustive draw would; tokens come with
their lookahead telemetry, and a seeded request is reproducible.
"""
from __future__ import annotations

import asyncio
import math
import time

import pytest

from loadtest.stats import chi_square_p, homogeneity_p
from workers.config import EngineConfig, ReplicaConfig

PROMPT = "My favourite animal is the"
ALPHA_EXACT = 1.0  # strong enough that q_α and q differ measurably at PROMPT over 400 draws
# The lazy draw evaluates at most this share of the candidates an exhaustive one would (about 0.4 of 12 at
# PROMPT with ALPHA_EXACT on one machine: the tail of the support is rarely a contender)
LAZY_SHARE = 0.6


@pytest.fixture(scope="module")
def core(model_dir):
    from prometheus_client import CollectorRegistry

    from workers.core import ReplicaCore
    from workers.pruning_state import STATE

    # float32: in bf16 a row's logits move by a few hundredths of a nat with the number of rows its step
    # computes, which varies with how the concurrent requests arrive, and PROMPT's 4th and 5th most likely
    # tokens are 0.09 nats apart on an AMX Xeon, so a draw's top-4 support could differ from the reference's
    config = ReplicaConfig(engine=EngineConfig(max_model_len=2048, max_num_seqs=16, kv_cache_space_gib=1,
                                               enforce_eager=True, dtype="float32"))
    core = ReplicaCore(config, replica_id="epic", metrics_registry=CollectorRegistry())
    yield core
    core.shutdown()
    STATE.attach_rows({})  # one engine per process: detach before another module starts its own


def _run(core, bodies, concurrency=16):
    from deployments.protocol import EntropicCompletionRequest

    async def one(body):
        overrides = body.pop("entropic", None)
        return [d async for d in core.generate("completion", EntropicCompletionRequest(**body), overrides)]

    async def all_of():
        core.start()
        out = []
        for i in range(0, len(bodies), concurrency):
            out += await asyncio.gather(*(one(dict(b)) for b in bodies[i:i + concurrency]))
        return out

    return asyncio.run(all_of())


def _survey(core, control, also=()):
    """The candidates at the end of PROMPT, their log-probabilities and lookahead entropies, as a draw sees them."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from workers.control_params import SamplingControl

    params = SamplingParams(temperature=1.0, max_tokens=1, seed=1, output_kind=RequestOutputKind.DELTA)
    params.extra_args = SamplingControl(enabled=False).request_args("survey", 1.0).into(None)
    prefix = core.runner.tokenizer.encode(PROMPT)

    async def survey():
        core.start()
        return await core.epic.survey("survey", prefix, params, control, also=also)

    return asyncio.run(survey())


def test_alpha_zero_draws_the_models_own_next_token(core):
    [reference] = _run(core, [{"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "logprobs": 8}])
    top = {tid: lp for tid, lp, rank, _ in reference[0].logprobs[0] if rank is not None and rank <= 4}
    ids = sorted(top, key=lambda t: -top[t])
    mass = sum(math.exp(top[t]) for t in ids)
    probs = [math.exp(top[t]) / mass for t in ids]  # q over its 4 most likely tokens
    n = 600
    runs = _run(core, [{"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "seed": i,
                        "entropic": {"decoding": "epic", "alpha": 0.0, "max_candidates": 4}} for i in range(n)])
    plain = _run(core, [{"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "top_k": 4, "seed": n + i}
                        for i in range(n)])
    drawn = [r[0].token_ids[0] for r in runs]
    assert set(drawn) <= set(ids)
    observed = [sum(1 for t in drawn if t == i) for i in ids]
    sampled = [sum(1 for r in plain if r[0].token_ids[0] == i) for i in ids]
    p, p_plain = chi_square_p(observed, probs), homogeneity_p(observed, sampled)
    print(f"alpha 0: epic {observed}, top-4 sampling {sampled}, expected {[round(x * n, 1) for x in probs]}; "
          f"p {p:.3f} against q, {p_plain:.3f} against sampling")
    # seeded draws: the verdict is fixed for a machine; 1e-3 is the chance of a false alarm on a new one
    assert p > 1e-3 and p_plain > 1e-3
    steps = [r[0].epic[0] for r in runs]
    assert all(s.candidates_evaluated == 0 and s.rollout_tokens == 0 and s.exact for s in steps)


def test_tilted_draws_match_q_alpha_computed_exhaustively_while_evaluating_fewer_candidates(core):
    """With a horizon of one token the lookahead estimate is exact and deterministic (the entropy of the position
    after the candidate, whichever token a rollout then draws), so q_α over the candidates can be computed
    exhaustively and the lazy draws compared with it."""
    from controller.laws.epic import tilted_probabilities
    from workers.control_params import EpicControl

    alpha, k, n = ALPHA_EXACT, 12, 400
    fields = {"decoding": "epic", "alpha": alpha, "horizon": 1, "rollouts": 1, "max_candidates": k}
    ids, logprobs, looks = _survey(core, EpicControl(**fields))
    target = tilted_probabilities(logprobs, [looks[t] for t in ids], alpha)
    runs = _run(core, [{"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "seed": i, "entropic": dict(fields)}
                       for i in range(n)])
    drawn = [r[0].token_ids[0] for r in runs]
    assert set(drawn) <= set(ids)
    observed = [drawn.count(t) for t in ids]
    p_tilted = chi_square_p(observed, target, min_expected=5)
    p_untilted = chi_square_p(observed, [math.exp(lp) for lp in logprobs], min_expected=5)
    evaluated = sum(r[0].epic[0].candidates_evaluated for r in runs)
    print(f"alpha {alpha}: drawn {observed}, q_alpha {[round(x * n, 1) for x in target]}, "
          f"q {[round(math.exp(lp), 3) for lp in logprobs]}; p {p_tilted:.3f} against q_alpha, "
          f"{p_untilted:.2g} against q; {evaluated} candidates evaluated, exhaustive: {k * n}")
    # seeded draws: each verdict is fixed for a machine; 1e-3 is the chance of a false alarm on a new one
    assert p_tilted > 1e-3
    assert p_untilted < 1e-3, "the tilt is too weak at this prefix for the test to tell q_alpha from q"
    assert all(r[0].epic[0].exact for r in runs)
    assert evaluated < LAZY_SHARE * k * n


def test_epic_tilts_lazily_with_telemetry_and_a_seed_reproduces_it(core):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 11,
            "entropic": {"decoding": "epic", "alpha": 0.5, "horizon": 3, "max_candidates": 6}}
    published: list[dict] = []
    publish = core.board.publish
    core.board.publish = lambda priorities: (published.append(dict(priorities)), publish(priorities))[1]
    try:
        first, again = _run(core, [body, body], concurrency=1)
    finally:
        core.board.publish = publish
    # the control loop ran while they did: their engine requests were ordered by their π
    children = [(p, k, pi) for p in published for k, pi in p.items() if "-epic-" in k]
    assert children, "no EPIC engine request was given a priority"
    assert all(pi == p[k.split("-epic-")[0]] for p, k, pi in children)
    tokens = [t for d in first for t in d.token_ids]
    assert tokens == [t for d in again for t in d.token_ids]
    assert first[-1].finished and first[-1].finish_reason in ("stop", "length")
    steps = [s for d in first for s in d.epic]
    print("epic steps:", steps)
    assert len(steps) == len(tokens) and all(len(d.entropy) == 1 for d in first)
    assert sum(s.candidates_evaluated for s in steps) > 0
    assert all(s.candidates_evaluated <= 6 and s.exact for s in steps)
    assert sum(s.rollout_tokens for s in steps) <= 3 * sum(s.candidates_evaluated for s in steps)
    evaluated = [s for s in steps if s.lookahead_entropy is not None]
    assert all(0.0 <= s.lookahead_entropy <= 3 * math.log(len(core.runner.tokenizer)) for s in evaluated)
    registry = core.metrics.registry
    assert registry.get_sample_value("entropic_epic_tokens_total", {"model_name": core.config.model_name,
                                                                    "exact": "true"}) >= 2 * len(tokens)
    assert registry.get_sample_value("entropic_epic_rollout_tokens_total", {"model_name": core.config.model_name}) \
        >= 2 * sum(s.rollout_tokens for s in steps)


def test_a_stop_token_ends_the_sequence_so_its_lookahead_entropy_is_zero(core):
    from workers.control_params import EpicControl

    eos = core.runner.tokenizer.eos_token_id
    names, logprobs, looks = _survey(core, EpicControl(decoding="epic", horizon=2), also=(eos,))
    assert looks[eos] == 0.0
    assert all(looks[n] > 0 for n in names if n != eos) and len(names) == len(logprobs) == 8


def test_untilted_tokens_are_one_engine_request_where_the_engine_samples_alike(core):
    """Where every remaining token is drawn untilted (α = 0, or the rollout budget spent), the rest of the output
    is one engine request sampling top-``max_candidates`` (counted here as the engine requests the runner was
    given), not one request per token; with top-p the engine would sample otherwise, so each token is drawn."""
    started: list[str] = []
    generate = core.runner.generate

    def counting(request_id, *args):
        started.append(request_id)
        return generate(request_id, *args)

    def run(extra, epic):
        started.clear()
        body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True, **extra,
                "entropic": {"decoding": "epic", "max_candidates": 4, **epic}}
        core.runner.generate = counting
        try:
            [deltas] = _run(core, [body])
        finally:
            core.runner.generate = generate
        steps = [s for d in deltas for s in d.epic]
        text = "".join(d.text for d in deltas)
        assert len(steps) == 10 and deltas[-1].finish_reason == "length" and text, (steps, deltas[-1])
        assert all(len(d.entropy) == len(d.token_ids) for d in deltas)
        return steps, [k for k in started if "-epic-" in k]

    steps, requests = run({}, {"alpha": 0.0})
    assert len(requests) == 1 and all(s.exact and s.candidates_evaluated == 0 for s in steps)
    steps, requests = run({"top_p": 0.95}, {"alpha": 0.0})
    assert len(requests) == 10, "top-p: each token drawn over the nucleus's candidates"
    # a budget of one candidate's rollout: the first token is tilted, the nine after it are not. At α = 2 the
    # admissible bounds are 2·2·log V ≈ 43 nats wide, more than any gap between the top 4 perturbed scores: no
    # candidate is ruled out unevaluated, so exactly one is evaluated
    steps, requests = run({}, {"alpha": 2.0, "horizon": 2, "rollout_budget": 2})
    assert steps[0].candidates_evaluated == 1 and steps[0].rollout_tokens == 2
    assert all(not s.exact and s.candidates_evaluated == 0 for s in steps[1:])
    assert len(requests) == 1 + 1 + 1, "the first token's distribution, its one rollout, then the rest"
    # a stop string ends the one request early: cut there, and the engine's request is aborted rather than left
    # to run to its 2000 tokens (tens of seconds here; an abort takes effect within a step)
    from deployments.protocol import EntropicCompletionRequest

    body = {"prompt": PROMPT, "max_tokens": 2000, "temperature": 1.0, "seed": 5, "ignore_eos": True, "stop": ["e"]}

    async def stopped_early():
        core.start()
        request = EntropicCompletionRequest(**body)
        deltas = [d async for d in core.generate("completion", request, {"decoding": "epic", "alpha": 0.0})]
        deadline = time.monotonic() + 10
        while core.runner.engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the engine request outlived the output it was for"
            await asyncio.sleep(0.02)
        return deltas

    deltas = asyncio.run(stopped_early())
    assert deltas[-1].finish_reason == "stop" and "e" not in "".join(d.text for d in deltas)


def test_epic_refuses_what_it_cannot_honour(core):
    from workers.errors import InvalidRequest

    for body, field in (({"temperature": 0.0}, "temperature"), ({"logprobs": 2}, "logprobs"), ({"logprobs": 0}, "logprobs"),
                        ({"entropic": {"decoding": "epic", "horizon": 0}}, "entropic")):
        request = {"prompt": PROMPT, "max_tokens": 2, "temperature": 1.0,
                   "entropic": {"decoding": "epic"}, **body}
        with pytest.raises(InvalidRequest) as caught:
            _run(core, [request])
        assert caught.value.param == field


def test_fit_epic_alpha_runs_end_to_end_on_a_tiny_configuration(model_dir, tmp_path):
    """The fitting tool as `make fit-epic-alpha` runs it (its own engine, in a process of its own)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "fit"
    subprocess.run([sys.executable, "-m", "loadtest.fit_epic_alpha", "--passages", "2", "--positions", "3",
                    "--context", "16", "--eager", "--no-store", "--out", str(out)], check=True, timeout=600,
                   capture_output=True, env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"})
    result = json.loads((out.parent / "fit.json").read_text())
    assert result["positions"] == 6 and math.isfinite(result["alpha"]) and len(result["gap"]) == 3
    assert result["fit"]["reference_mean"] >= 0 and result["fit"]["model_mean"] >= 0
    assert set(result["held_out"]) == {"alpha_fitted_on_even_passages", "error_at_0", "error_at_fit", "data_mean"}
    assert "EPIC: α fitted on held-out text" in (out.parent / "fit.md").read_text()


def test_bench_epic_runs_end_to_end_on_a_tiny_configuration(model_dir, tmp_path):
    """The benchmark as `make bench-epic` runs it (its own engine, in a process of its own), cut to a few tokens."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "epic"
    subprocess.run([sys.executable, "-m", "loadtest.bench_epic", "--passages", "2", "--context", "16", "--length", "4",
                    "--samples", "2", "--questions", "1", "--rounds", "1", "--methods", "top-k", "typical", "epic",
                    "--alpha-range", "0.2", "0.8", "--bisect-steps", "2", "--epic-bisect-steps", "2", "--eager",
                    "--out", str(out)],
                   check=True, timeout=600, capture_output=True,
                   env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"})
    result = json.loads((out.parent / "epic.json").read_text())
    methods = result["methods"]
    assert list(methods) == ["plain", "top-k", "typical", "epic"] and result["questions"] == 1
    assert result["reference_ce"]["held_out"] > 0 and methods["plain"]["wall_vs_plain"] == [1.0, 1.0, 1.0]
    assert [len(result["tuning"][m]) for m in methods] == [1, 2, 2, 2]  # the plain reference is not tuned
    assert methods["top-k"]["knob"] == round(methods["top-k"]["knob"]) and 0.3 < methods["typical"]["knob"] < 1.0
    assert 0.2 < methods["epic"]["knob"] < 0.8
    for row in methods.values():
        assert row["output_tokens"] > 0 and math.isfinite(row["calibration_error"]) and 0 <= row["accuracy"][0] <= 1
    # at α ≠ 0 a token whose support holds two candidates or more has its front-runner's lookahead estimated
    assert methods["epic"]["candidates_per_token"] > 0 and methods["top-k"]["candidates_per_token"] == 0
    assert all(os.path.exists(p) for p in result["plots"])
    assert "EPIC against temperature" in (out.parent / "epic.md").read_text()


def test_the_replica_reads_the_alpha_fitted_beside_the_model(tmp_path):
    from workers.model_store import EPIC_FIT_FILE, fitted_epic_alpha

    assert fitted_epic_alpha(tmp_path) == 0.0  # none fitted: no tilt
    (tmp_path / EPIC_FIT_FILE).write_text('{"alpha": 0.25, "horizon": 4}')
    assert fitted_epic_alpha(tmp_path) == 0.25
