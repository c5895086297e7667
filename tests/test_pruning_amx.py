"""KV pruning on vLLM's AMX attention (bf16 on CPUs with AMX tiles), on the real engine and the default model.

vLLM's CPU attention packs the key cache as AMX tiles when it runs bf16 on such a CPU, which is what
``make serve`` runs there (``dtype: auto``); tests/test_pruning_fidelity.py runs float32, whose
kernel ("vec") keeps the keys channel-major. The layout itself is pinned on any CPU by
tests/test_vllm_pins.py; what needs AMX hardware is vLLM's kernel reading the compacted block table,
so this module skips, saying why, on CPUs without it.
"""
from __future__ import annotations

import pytest
import torch

from loadtest.pruned_requests import dense_and_kept_all, generate_counting_kept, greedy_params
from loadtest.workload import passkey_prompt
from workers.control_params import PruningControl

pytestmark = pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                                reason="no AMX tiles on this CPU: vLLM's CPU attention runs its AMX kernel only there")

# ~4K tokens of filler, passkey at three depths (test_pruning_fidelity.py covers 2K-7K in float32)
CASES = [(170, depth) for depth in (0.2, 0.5, 0.8)]
AGGRESSIVE = PruningControl(budget="fixed", keep_min=0.25)


@pytest.fixture(scope="module")
def llm(model_dir):
    from workers.engine import configure_process_env

    configure_process_env(2, 2)
    from vllm import LLM

    from workers.pruned_attention import PrunedCPUAttentionBackend
    from workers.pruning_state import STATE
    from workers.sampling import EntropicLogitsProcessor

    engine = LLM(model=str(model_dir), enforce_eager=True, dtype="bfloat16", max_model_len=8192, max_num_seqs=4,
                 block_size=64, seed=0, logits_processors=[EntropicLogitsProcessor])
    runner = engine.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    group = runner.attn_groups[0][0]
    assert group.backend is PrunedCPUAttentionBackend, f"the plugin did not install the pruned backend: {group.backend}"
    isas = {getattr(layer, "isa", None) for layer in runner.compilation_config.static_forward_context.values()}
    assert isas == {"amx"}, f"vLLM chose {isas} for bf16 on this AMX CPU, not the layout under test"
    yield engine
    STATE.attach_rows({})  # one engine per process: detach before another test module starts its own


@pytest.fixture(scope="module")
def passkeys(llm):
    keys = [20011 + 7919 * i for i in range(len(CASES))]
    prompts = [passkey_prompt(reps, depth, key) for (reps, depth), key in zip(CASES, keys)]
    _generate(llm, prompts, None, 1)  # warm the prefix cache: dense and pruned runs read the same blocks
    return prompts, keys


def _generate(llm, prompts, pruning, max_tokens):
    params = [greedy_params(max_tokens, pruning)[0] for _ in prompts]
    return generate_counting_kept(llm, prompts, params)


def test_everything_kept_through_the_pruned_path_is_identical_to_dense(llm, passkeys):
    dense, kept_all, ratio = dense_and_kept_all(llm, passkeys[0], 16)
    assert ratio == 1.0
    assert [o.outputs[0].token_ids for o in kept_all] == [o.outputs[0].token_ids for o in dense]


def test_passkey_accuracy_pruned_equals_dense(llm, passkeys):
    prompts, keys = passkeys
    dense, _ = _generate(llm, prompts, None, 12)
    pruned, ratio = _generate(llm, prompts, AGGRESSIVE, 12)
    dense_ok = [str(k) in o.outputs[0].text for o, k in zip(dense, keys)]
    pruned_ok = [str(k) in o.outputs[0].text for o, k in zip(pruned, keys)]
    print(f"amx passkey dense {sum(dense_ok)}/{len(keys)} pruned {sum(pruned_ok)}/{len(keys)} kept ratio {ratio:.2f}")
    assert ratio < 0.4, "the aggressive setting must actually prune on the AMX kernel"
    assert sum(dense_ok) == len(keys), "the model finds every ~4K passkey with dense attention in bf16"
    assert pruned_ok == dense_ok, [o.outputs[0].text for o in pruned]
