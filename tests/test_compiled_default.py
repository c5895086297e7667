"""The engine as shipped is compiled (``engine.enforce_eager: false``): every control layer still acts.

The served-app tests pin eager mode (TEST_APP_CONFIG) because compiling costs minutes per engine on
these machines; this module is where the default itself runs, in process, through the replica core:
a long prompt decoded on the pruned attention path, a sampled request under the temperature law, and a
second engine process that loads the compiled model the first one saved.
"""
from __future__ import annotations

import asyncio

import pytest

from controller.messages import ControllerAnswer
from loadtest.workload import passkey_prompt
from workers.config import EngineConfig, ReplicaConfig

# Only the sizes change from the shipped defaults; the mode, dtype choice and control layers do not.
ENGINE = {"max_model_len": 4096, "max_num_seqs": 4, "kv_cache_space_gib": 1}
GREEDY = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 16, "temperature": 0}

# A second engine process with the fixture's configuration: whether it loaded the compiled model the first one
# saved, and what it answers GREEDY
SECOND_START = """
import asyncio, json, sys
from prometheus_client import CollectorRegistry
from vllm.compilation.counter import compilation_counter
from deployments.protocol import EntropicChatCompletionRequest
from workers.config import EngineConfig, ReplicaConfig
from workers.core import ReplicaCore

engine, greedy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
core = ReplicaCore(ReplicaConfig(engine=EngineConfig(**engine)), replica_id="second", metrics_registry=CollectorRegistry())

async def run():
    core.start()
    deltas = [d async for d in core.generate("chat", EntropicChatCompletionRequest(**greedy))]
    return [t for d in deltas for t in d.token_ids]

tokens = asyncio.run(run())
print("RESULT " + json.dumps({"loaded": compilation_counter.num_aot_artifacts_loaded, "tokens": tokens}))
core.shutdown()
"""


def test_the_shipped_engine_default_is_compiled():
    assert EngineConfig().enforce_eager is False


@pytest.fixture(scope="module")
def core(model_dir):
    from prometheus_client import CollectorRegistry

    from workers.core import ReplicaCore
    from workers.pruning_state import STATE

    config = ReplicaConfig(engine=EngineConfig(**ENGINE))
    assert not config.engine.enforce_eager
    reports: list[tuple[int, frozenset, bool]] = []

    async def controller(report):  # in place of the controller deployment: records what the replica sends
        reports.append((core.runner.steps, frozenset(report.sequences), report.metrics is not None))
        return ControllerAnswer(priorities={})

    core = ReplicaCore(config, replica_id="compiled", metrics_registry=CollectorRegistry(), controller=controller)
    core.reports = reports
    yield core
    core.shutdown()
    STATE.attach_rows({})  # one engine per process: detach before another module starts its own


def _run(core, requests):
    from deployments.protocol import EntropicChatCompletionRequest

    async def one(body):
        return [d async for d in core.generate("chat", EntropicChatCompletionRequest(**body))]

    async def all_of():
        core.start()
        return await asyncio.gather(*(one(b) for b in requests))

    return asyncio.run(all_of())


def test_compiled_engine_runs_pruning_and_the_temperature_law(core):
    long_prompt = passkey_prompt(120, 0.5, 48613)  # ~2.9K tokens: many 64-token blocks to choose from
    long, sampled = _run(core, [
        {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 24, "temperature": 0},
        {"messages": [{"role": "user", "content": "Write a short poem about the sea."}], "max_tokens": 48,
         "temperature": 1.0, "seed": 7},
    ])
    assert long[-1].finished and sampled[-1].finished
    steps = [kb for d in long for kb in d.kv_blocks]
    assert steps, "no decode step of the long prompt went through the pruned attention path"
    assert any(kept < total for kept, total in steps), f"pruning kept every block on every step: {steps[:5]}"
    temps = [t for d in sampled for t in d.temperature]
    entropies = [h for d in sampled for h in d.entropy]
    assert len(temps) == len(entropies) == sum(len(d.token_ids) for d in sampled) > 0
    # The law starts at the request's temperature and moves it from the measured entropy
    assert len(set(round(t, 6) for t in temps)) > 1, "the temperature law never changed the temperature"


def test_sampled_requests_draw_through_the_kernel_top_p_too_and_seeded_ones_through_vllm(core, monkeypatch):
    """workers/cpu_sampler.py on the shipped engine: steps of unseeded sampled requests draw with the kernel, after
    the request's top-k and top-p where it sets them, and its min-p in place of vLLM's min-p pass, and penalties go
    through their kernel; a seeded request's steps are vLLM's, so its tokens are the same on every run."""
    from vllm.v1.sample.logits_processor import MinPLogitsProcessor

    import workers.cpu_sampler as module
    from workers import engine

    calls = []
    kernel = module.sample_rows
    monkeypatch.setattr(module, "sample_rows", lambda logits, seeds: calls.append(len(seeds)) or kernel(logits, seeds))
    poem = {"messages": [{"role": "user", "content": "Write a short poem about the sea."}], "max_tokens": 12,
            "temperature": 1.0, "ignore_eos": True}
    plain, = _run(core, [poem])
    assert sum(len(d.token_ids) for d in plain) == 12 and len(calls) == 12
    filtered = []
    kernel_filtered = module.sample_rows_filtered
    monkeypatch.setattr(module, "sample_rows_filtered", lambda logits, seeds, k, p, mp: filtered.append(
        (k, p, mp)) or kernel_filtered(logits, seeds, k, p, mp))
    calls.clear()
    nucleus, = _run(core, [{**poem, "top_p": 0.9, "top_k": 40}])
    assert sum(len(d.token_ids) for d in nucleus) == 12 and len(filtered) == 12 and calls == []
    k, p, mp = filtered[0]
    assert int(k[0]) == 40 and abs(float(p[0]) - 0.9) < 1e-6 and mp is None
    min_p, = [q for q in engine.model_runner(core.runner.engine).input_batch.logitsprocs.all
              if isinstance(q, MinPLogitsProcessor)]
    assert min_p.apply is module._left_to_the_draw, "vLLM's min-p pass was not folded into the draw"
    filtered.clear()
    _run(core, [{**poem, "min_p": 0.2}])
    assert len(filtered) == 12 and calls == [] and abs(float(filtered[0][2][0]) - 0.2) < 1e-6
    penalized = []
    kernel_penalties = module.apply_penalties
    monkeypatch.setattr(module, "apply_penalties",
                        lambda *a: penalized.append([len(o) for o in a[5]]) or kernel_penalties(*a))
    _run(core, [{**poem, "repetition_penalty": 1.3, "frequency_penalty": 0.5}])
    assert penalized == [[n] for n in range(12)], "each step's penalties by the kernel, with the outputs so far"
    calls.clear()
    filtered.clear()
    seeded = [[t for d in deltas for t in d.token_ids] for deltas in (_run(core, [{**poem, "seed": 5}])[0],
                                                                         _run(core, [{**poem, "seed": 5}])[0])]
    assert calls == [] and filtered == [] and seeded[0] == seeded[1] and len(seeded[0]) == 12


def test_decode_steps_of_a_float32_engine_read_its_bfloat16_checkpoint_as_bfloat16(core, monkeypatch):
    """workers/decode_weights.py on the shipped engine, where it runs float32 (CPUs without native bf16; the default
    model's checkpoint is bf16): every linear layer and the tied LM head hold the bfloat16 panels, and the compiled
    graph runs steps of at most engine.bf16_decode_weights rows on the kernel, larger ones on vLLM's GEMM."""
    import torch

    from kernels import cpu_linear
    from workers import engine

    if core.runner.engine.vllm_config.model_config.dtype != torch.float32:
        pytest.skip("this CPU runs the engine in bf16: its weights are bf16 already")
    model = engine.model_runner(core.runner.engine).model
    layers = [m for m in model.modules() if hasattr(m, "weight_bf16_panels")]
    hf = core.runner.engine.vllm_config.model_config.hf_config
    assert len(layers) == 4 * hf.num_hidden_layers + 1  # qkv, o, gate_up, down in each layer; the LM head
    calls: list[int] = []
    kernel = cpu_linear.linear_bf16w
    monkeypatch.setattr(cpu_linear, "linear_bf16w", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    deltas, = _run(core, [{**GREEDY, "max_tokens": 8, "ignore_eos": True}])
    assert sum(len(d.token_ids) for d in deltas) == 8
    limit = core.config.engine.bf16_decode_weights
    limit = cpu_linear.rows() if limit == "auto" else limit
    # the prompt's prefill: its LM head row only; each of the 7 decode steps: every layer, one row
    assert calls.count(1) == 1 + 7 * len(layers) and max(calls) <= limit


def test_reports_follow_engine_steps_not_the_clock(core):
    """A long prefill chunk outlasts many control periods; the replica reports again only once the engine
    has stepped (or its requests changed), plus the once-a-second metrics report."""
    core.reports.clear()
    _run(core, [{"messages": [{"role": "user", "content": passkey_prompt(120, 0.3, 7)}], "max_tokens": 4,
                 "temperature": 0}])
    assert any(seqs for _, seqs, _ in core.reports), "the replica never reported its sequences"
    telemetry = [(step, seqs) for step, seqs, metrics in core.reports if not metrics]
    repeats = [a for a, b in zip(telemetry, telemetry[1:]) if a == b]
    assert not repeats, f"{len(repeats)} reports repeated an engine step already reported: {repeats[:3]}"


def test_routing_step_time_comes_from_decode_steps_only(core):
    """The unit step time a replica advertises for routing leaves out steps that prefilled a prompt: the
    engine flags a step decode-only only when every request it ran produced a token past its first."""
    seen: list[tuple[float, list[bool], bool]] = []
    observe = core.runner._on_step

    def record(step_s, estimator_s, deltas, decode_only):
        seen.append((step_s, [d.completion_tokens == len(d.token_ids) for d in deltas], decode_only))
        observe(step_s, estimator_s, deltas, decode_only)

    core.runner._on_step = record
    try:
        _run(core, [
            {"messages": [{"role": "user", "content": passkey_prompt(120, 0.6, 31)}], "max_tokens": 6, "temperature": 0},
            {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24, "temperature": 0},
        ])
    finally:
        core.runner._on_step = observe
    first_tokens = [s for s in seen if any(s[1])]  # a request's first token: its prompt was prefilled then
    assert first_tokens and not any(flag for *_, flag in first_tokens)
    assert any(flag for *_, flag in seen), "no step was flagged decode-only"
    slowest_prefill = max(step_s for step_s, *_ in first_tokens)
    assert core.metrics.recent_unit_step_s < slowest_prefill, (core.metrics.recent_unit_step_s, slowest_prefill)


def test_deltas_carry_the_stop_token_mass_that_ends_the_request(core):
    """The remaining-work predictor's stop feature (workers.sampling): the mass on the request's stop
    tokens at each step, high at the step where greedy decoding picks EOS. (Asked to answer in one word: in bf16 the
    plain question ran past 64 tokens.)"""
    deltas, = _run(core, [{"messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                           "max_tokens": 64, "temperature": 0}])
    assert deltas[-1].finish_reason == "stop", "the greedy answer did not end at EOS within 64 tokens"
    stops = [d.stop_prob for d in deltas if d.token_ids]
    assert all(p is not None and 0.0 <= p <= 1.0 for p in stops), stops
    # greedy picked EOS at the last step, so EOS had the most mass there; before, another token had more
    assert stops[-1] > 0.2 and stops[-1] > max(stops[:-1]), stops


def test_a_second_start_loads_the_compiled_model_the_first_saved(core):
    """workers/aot_cache.py: an engine started with a configuration an earlier start compiled loads the model
    that start saved instead of tracing and compiling it again, and answers as the first engine does."""
    import json
    import os
    import subprocess
    import sys

    from torch._inductor import config as inductor

    first, = _run(core, [GREEDY])
    # vLLM keys the saved model by this process's VLLM_* variables (kept as they are) and by inductor's global
    # config, which torch reads from the environment at its import: vLLM's CPU platform sets
    # TORCHINDUCTOR_CPP_DYNAMIC_THREADS when an engine starts, after this process had read it, and the second
    # process must read what this one did (a replica's engine process never inherits the variable)
    env = {**os.environ, "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1" if inductor.cpp.dynamic_threads else "0"}
    done = subprocess.run([sys.executable, "-c", SECOND_START, json.dumps(ENGINE), json.dumps(GREEDY)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["loaded"] == 1, "the second start compiled the model again instead of loading it"
    assert result["tokens"] == [t for d in first for t in d.token_ids]


def test_a_stream_whose_event_loop_closed_is_aborted_and_the_engine_goes_on(core):
    """A caller's event loop can close while its stream is open (a harness that ended without closing
    it). The engine thread hands a step's deltas to each loop in one call, and a closed loop cannot take
    them: that request is aborted in the engine, and the engine serves the next one (this module's
    last test: the abandoned generator's bookkeeping in the core is never unwound)."""
    import time

    from deployments.protocol import EntropicChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "Count from one to a hundred."}], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True}
    loop = asyncio.new_event_loop()
    stream = core.generate("chat", EntropicChatCompletionRequest(**body))
    first = loop.run_until_complete(stream.__anext__())
    assert first.token_ids and not first.finished
    loop.close()
    deadline = time.monotonic() + 30
    while core.runner.scheduler_counts() != (0, 0):
        assert time.monotonic() < deadline, "the engine kept stepping a request nobody can read"
        time.sleep(0.1)
    assert core.runner.alive
    again, = _run(core, [{**body, "max_tokens": 8}])
    assert again[-1].finished and sum(len(d.token_ids) for d in again) == 8
