"""Our decode kernel (kernels/cpu_decode_attention) in the real engine with the default model: pruned decode
steps in bf16 on one engine thread, as a served replica on a small CPU runs them, and on two (rows over the
engine's OpenMP threads, as larger replicas run), and dense (unpruned) decode steps, against vLLM's own CPU
attention on the same requests.

Skipped where the CPU has no AVX512-BF16: the kernel does not run there, and vLLM's attention, which then
serves every step, is what tests/test_pruning_fidelity.py covers.
"""
from __future__ import annotations

import pytest

from kernels.cpu_decode_attention import available, parallel
from loadtest.pruned_requests import generate_counting_kept, greedy_params
from loadtest.workload import passkey_prompt
from workers.control_params import PruningControl

AGGRESSIVE = PruningControl(budget="fixed", keep_min=0.25)
CASES = [(reps, depth) for reps in (85, 170) for depth in (0.2, 0.5, 0.8)]  # ~2K and ~4K tokens


@pytest.fixture(scope="module")
def llm(model_dir):
    if not available():
        pytest.skip("no AVX512-BF16 on this CPU: the decode kernel does not run here")
    from workers.engine import configure_process_env

    configure_process_env(1, 4)
    from vllm import LLM

    from workers.pruning_state import STATE
    from workers.sampling import EntropicLogitsProcessor

    engine = LLM(model=str(model_dir), enforce_eager=True, dtype="bfloat16", max_model_len=8192, max_num_seqs=4,
                 seed=0, logits_processors=[EntropicLogitsProcessor])
    yield engine
    STATE.attach_rows({})  # one engine per process: detach before another test module starts its own


def _run(llm, prompts, kernel: bool, threads: int = 1, pruning: PruningControl | None = AGGRESSIVE
         ) -> tuple[list, float, int]:
    import torch

    from workers.pruning_state import STATE

    STATE.decode_kernel = kernel
    calls = STATE.stats.decode_kernel_layers
    torch.set_num_threads(threads)  # the engine runs in this process (configure_process_env)
    try:
        outs, ratio = generate_counting_kept(llm, prompts, [greedy_params(12, pruning)[0] for _ in prompts])
    finally:
        STATE.decode_kernel = True
        torch.set_num_threads(1)
    return outs, ratio, STATE.stats.decode_kernel_layers - calls


def test_pruned_steps_run_our_kernel_and_find_the_passkeys_vllms_attention_finds(llm):
    from prometheus_client import CollectorRegistry

    from workers.metrics import ReplicaMetrics

    keys = [20011 + 7919 * i for i in range(len(CASES))]
    prompts = [passkey_prompt(reps, depth, key) for (reps, depth), key in zip(CASES, keys)]
    generate_counting_kept(llm, prompts, [greedy_params(1)[0] for _ in prompts])  # both runs read the same cache
    registry = CollectorRegistry()
    metrics = ReplicaMetrics("m", registry=registry)  # the replica's Prometheus series, read from the same counts

    def exported() -> float:
        metrics._observe_pruning()
        return registry.get_sample_value("entropic_decode_kernel_layers_total", {"model_name": "m"})

    theirs, ratio_theirs, calls_theirs = _run(llm, prompts, kernel=False)
    before = exported()
    ours, ratio_ours, calls_ours = _run(llm, prompts, kernel=True)
    assert exported() - before == calls_ours

    assert ratio_ours < 0.4 and ratio_theirs == ratio_ours, "both runs must prune, and keep as many blocks"
    assert calls_theirs == 0
    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    assert calls_ours >= layers * 10, "the pruned decode steps ran our kernel"  # 11 decode steps, any batching
    found = [[str(k) in o.outputs[0].text for o, k in zip(outs, keys)] for outs in (theirs, ours)]
    print(f"passkeys found, pruned, vLLM's attention {sum(found[0])}/{len(keys)}, ours {sum(found[1])}/{len(keys)}")
    assert sum(found[0]) >= 2, "too few passkeys found for the comparison to mean anything"
    assert found[1] == found[0], ([o.outputs[0].text for o in theirs], [o.outputs[0].text for o in ours])

    if not parallel():
        return  # a build without OpenMP leaves steps on two threads to vLLM's kernel
    two, ratio_two, calls_two = _run(llm, prompts, kernel=True, threads=2)
    assert ratio_two == ratio_ours and calls_two >= layers * 10, "on two threads the kernel runs as well"
    assert [str(k) in o.outputs[0].text for o, k in zip(two, keys)] == found[0], [o.outputs[0].text for o in two]


def test_unpruned_decode_steps_run_our_kernel_too(llm):
    keys = [30011 + 7919 * i for i in range(len(CASES))]
    prompts = [passkey_prompt(reps, depth, key) for (reps, depth), key in zip(CASES, keys)]
    generate_counting_kept(llm, prompts, [greedy_params(1)[0] for _ in prompts])
    theirs, ratio_theirs, calls_theirs = _run(llm, prompts, kernel=False, pruning=None)
    ours, ratio_ours, calls_ours = _run(llm, prompts, kernel=True, pruning=None)
    assert ratio_theirs == ratio_ours == 1.0, "nothing pruned"
    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    assert calls_theirs == 0 and calls_ours >= layers * 10, "the dense decode steps ran our kernel"
    found = [[str(k) in o.outputs[0].text for o, k in zip(outs, keys)] for outs in (theirs, ours)]
    print(f"passkeys found, dense, vLLM's attention {sum(found[0])}/{len(keys)}, ours {sum(found[1])}/{len(keys)}")
    assert sum(found[0]) >= 2, "too few passkeys found for the comparison to mean anything"
    assert found[1] == found[0], ([o.outputs[0].text for o in theirs], [o.outputs[0].text for o in ours])
