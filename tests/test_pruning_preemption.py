"""Entropic KV pruning through preemption and resume, on the real engine and the default model.

Its own engine process (a KV cache a block too small for two ~2K-token passkey requests to finish
side by side, so vLLM must preempt one and resume it by recomputation), since the other real-engine
tests share one engine with a cache far too large to preempt. Preemption is counted by wrapping vLLM's
Scheduler._preempt_request in that process (instrumentation only; the scheduler itself runs unchanged).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, sys
    from workers.engine import configure_process_env
    configure_process_env(2, 1)
    from vllm import LLM
    from vllm.v1.core.sched.scheduler import Scheduler
    from loadtest.pruned_requests import greedy_params
    from loadtest.workload import passkey_prompt
    from workers.control_params import PruningControl
    from workers.pruning_state import STATE
    from workers.sampling import EntropicLogitsProcessor

    preempted = []
    original = Scheduler._preempt_request
    def counting(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return original(self, request, *args, **kwargs)
    Scheduler._preempt_request = counting

    model, blocks = sys.argv[1], int(sys.argv[2])
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=4096, max_num_seqs=2, seed=0,
              block_size=128, num_gpu_blocks_override=blocks, enable_prefix_caching=False,
              logits_processors=[EntropicLogitsProcessor])
    keys = [48611, 70937]
    prompts = [passkey_prompt(85, depth, key) for depth, key in zip((0.3, 0.7), keys)]
    pruning = PruningControl(budget="fixed", keep_min=0.25)
    outs = llm.generate(prompts, [greedy_params(120, pruning)[0] for _ in prompts], use_tqdm=False)
    print(json.dumps({
        "preemptions": len(preempted),
        "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
        "generated": [len(o.outputs[0].token_ids) for o in outs],
        "found": [str(k) in o.outputs[0].text for o, k in zip(outs, keys)],
        "kept_ratio": STATE.stats.blocks_kept / max(1, STATE.stats.blocks_total),
    }))
""")


def test_pruned_requests_survive_preemption_and_resume(model_dir):
    # two prompts of 2092 tokens hold 17 blocks of 128 each (no prefix caching, so no shared blocks); both
    # need an 18th block during decode, and 35 blocks leave room for only one: the other is preempted
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), "35"], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"preemption with pruning: {report}")
    # 17 blocks each, and the 18th needed before the 120th new token
    assert all(17 * 128 - 120 < n <= 17 * 128 for n in report["prompt_tokens"]), report
    assert report["preemptions"] >= 1, "the cache was meant to force a preemption"
    assert report["generated"] == [120, 120], "every request must complete after resuming"
    assert report["found"] == [True, True], "pruned decoding after resume must still retrieve the passkeys"
    assert report["kept_ratio"] < 0.5, "pruning must be active before and after the preemption"
