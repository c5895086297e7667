"""Greedy requests through our engine path, shared by the pruning tests and benchmarks (offline ``vllm.LLM``).

``greedy_params`` builds the SamplingParams the way ``workers.prompts.sampling_params`` does for a
served request (our ``entropic`` args, the pruning args, vLLM's raw logprob of each sampled token when
the pruner needs surprisal), plus the optional fidelity args of ``loadtest.instruments``.
``generate_counting_kept`` runs a batch and returns the share of KV blocks the pruner attended;
``dense_and_kept_all`` runs a batch dense and then through the pruned path with every block kept.
"""
from __future__ import annotations

import uuid
from typing import Any

from workers.control_params import PruningControl, SamplingControl


def greedy_params(max_tokens: int, pruning: PruningControl | None = None, *, t_cal: float = 1.0,
                  fidelity: dict[str, Any] | None = None, context_tokens: int = 8192) -> tuple[Any, str]:
    """(SamplingParams, request key); ``context_tokens``: the longest the request can get (prompt + output)."""
    from vllm import SamplingParams

    key = uuid.uuid4().hex
    extra = SamplingControl(t_cal=t_cal).request_args(key, 0.0, pruning).into(None)
    if fidelity is not None:  # loadtest.instruments: {"scale": s} or {"force": [ids]}
        extra.update({f"fidelity_{k}": v for k, v in fidelity.items()}, fidelity_key=key)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    if pruning is not None and pruning.wants_surprisal(context_tokens):
        params.logprobs = 0
    return params, key


def generate_counting_kept(llm: Any, prompts: list[str], params: list[Any]) -> tuple[list[Any], float]:
    """The outputs and the fraction of KV blocks attended over the batch's decode steps (1.0: nothing pruned)."""
    from workers.pruning_state import STATE

    kept, total = STATE.stats.blocks_kept, STATE.stats.blocks_total
    outs = llm.generate(list(prompts), list(params), use_tqdm=False)
    total = STATE.stats.blocks_total - total
    return outs, (STATE.stats.blocks_kept - kept) / total if total else 1.0


def dense_and_kept_all(llm: Any, prompts: list[str], max_tokens: int) -> tuple[list[Any], list[Any], float]:
    """Greedy outputs with dense attention, then through the pruned path with every block kept (each row
    forced through selection and the compacted table), and the second run's kept fraction: the pruned
    path itself must change no token."""
    from workers.pruning_state import STATE

    dense, _ = generate_counting_kept(llm, prompts, [greedy_params(max_tokens)[0] for _ in prompts])
    STATE.always_select = True
    try:
        kept_all, ratio = generate_counting_kept(
            llm, prompts, [greedy_params(max_tokens, PruningControl(keep_min=1.0))[0] for _ in prompts])
    finally:
        STATE.always_select = False
    return dense, kept_all, ratio
