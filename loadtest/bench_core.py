"""What the replica's own path costs: the replica core against the same vLLM engine stepped bare.

    make bench-core ARGS="--rounds 4"       (writes docs/results/core-overhead.{md,json})

One process holds two things built from the same ``EngineConfig``: a ``workers.core.ReplicaCore`` as
it serves (engine on its own thread, requests through ``ReplicaCore.generate``, entropy telemetry
on unless ``--no-telemetry``, control step running; sampling control, pruning and π scheduling off,
since they change what is computed) and a bare ``LLMEngine`` (no logits processor of ours), stepped
in a plain loop by the caller.
Our vLLM plugin is not loaded (``VLLM_PLUGINS``), so both run vLLM's own CPU attention: what differs
is the replica's path around the engine, not the attention backend. ``--with-plugin`` loads it, as
serving does: both arms then run our attention backend, and the core's requests carry the entropic
arguments it reads each step. Each round sends the same ``--requests`` chat prompts to both, in
alternating order, greedy with ``ignore_eos`` to ``--max-tokens`` each: a decode-speed measurement,
the same tokens on both sides. ``--temperature`` above 0 samples instead (the same number of tokens,
not the same ones): the core then draws with its CPU sampler (``--cpu-sampler``, ``engine.cpu_sampler``)
and the bare engine with vLLM's, both after ``--top-k`` / ``--top-p`` where given. The penalty options
apply to both arms, greedy or sampled (the core's CPU sampler applies them with its kernel). The ratio is
core / bare output tokens per second, per round.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics as st
import sys
import time

PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how photosynthesis works.",
           "Describe the city of Paris to a tourist.", "Write a poem about the ocean.",
           "List ten uses of a paperclip.", "Summarize the plot of a heist movie.",
           "Explain recursion to a child.", "Describe a walk in a forest in autumn."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--with-plugin", action="store_true",
                        help="load our vLLM plugin (as serving does): both arms then run our CPU attention backend")
    parser.add_argument("--no-telemetry", action="store_true",
                        help="the core without entropy telemetry (telemetry: false), to tell its cost from the rest")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (the same tokens in both arms); above 0: random sampling at it")
    parser.add_argument("--cpu-sampler", choices=("inverse_cdf", "vllm"), default="inverse_cdf",
                        help="the core's engine.cpu_sampler (random sampling only)")
    parser.add_argument("--top-k", type=int, default=None, help="every request's top_k (random sampling only)")
    parser.add_argument("--top-p", type=float, default=None, help="every request's top_p (random sampling only)")
    parser.add_argument("--min-p", type=float, default=None, help="every request's min_p (random sampling only)")
    for name in PENALTIES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=None, help=f"every request's {name}")
    parser.add_argument("--out", default="docs/results/core-overhead")
    args = parser.parse_args(argv)
    if not args.with_plugin:  # before vLLM loads its plugins: vLLM's own CPU attention in both arms
        os.environ["VLLM_PLUGINS"] = "none-of-ours"

    from prometheus_client import CollectorRegistry

    from controller.config import SchedulingConfig
    from deployments.protocol import EntropicChatCompletionRequest
    from loadtest.machine import cpu_text, publish
    from workers.config import EngineConfig, ReplicaConfig
    from workers.control_params import PruningControl, SamplingControl
    from workers.core import ReplicaCore
    from workers.model_store import resolve_model

    engine = EngineConfig(max_model_len=4096, max_num_seqs=args.max_num_seqs, cpu_threads=args.threads,
                          cpu_sampler=args.cpu_sampler)
    config = ReplicaConfig(engine=engine, telemetry=not args.no_telemetry, sampling=SamplingControl(enabled=False),
                           pruning=PruningControl(enabled=False), scheduling=SchedulingConfig(enabled=False))
    core = ReplicaCore(config, replica_id="core", metrics_registry=CollectorRegistry())
    from vllm import EngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    model = str(resolve_model(config.model))
    bare = LLMEngine.from_engine_args(EngineArgs(**{**engine.engine_kwargs(model, config.model),
                                                    "disable_log_stats": True}))
    filters = {k: getattr(args, k) for k in ("top_k", "top_p", "min_p", *PENALTIES) if getattr(args, k) is not None}
    requests = [EntropicChatCompletionRequest(messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                              max_tokens=args.max_tokens, temperature=args.temperature,
                                              ignore_eos=True, **filters)
                for i in range(args.requests)]
    from workers.prompts import prompt_token_ids

    prompt_ids = [prompt_token_ids("chat", r, core.runner.tokenizer) for r in requests]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA, **filters)

    def run_bare(tag: str) -> float:
        for i, ids in enumerate(prompt_ids):
            bare.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
        start, produced = time.perf_counter(), 0
        while bare.has_unfinished_requests():
            produced += sum(len(o.outputs[0].token_ids) for o in bare.step())
        return produced / (time.perf_counter() - start)

    async def run_core() -> float:
        async def one(request) -> int:
            return sum([len(d.token_ids) async for d in core.generate("chat", request)])
        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(one(r) for r in requests)))
        return produced / (time.perf_counter() - start)

    rates: dict[str, list[float]] = {"bare": [], "core": []}

    async def rounds() -> None:
        core.start()
        run_bare("warm")
        await run_core()
        for r in range(args.rounds):
            for arm in (("bare", "core") if r % 2 == 0 else ("core", "bare")):
                rates[arm].append(run_bare(f"r{r}") if arm == "bare" else await run_core())
            print(f"round {r + 1}: bare {rates['bare'][-1]:.1f} tok/s, core {rates['core'][-1]:.1f} tok/s",
                  file=sys.stderr, flush=True)

    asyncio.run(rounds())
    ratios = [c / b for c, b in zip(rates["core"], rates["bare"])]

    def render(result: dict) -> str:
        m = result["machine"]
        return "\n".join([
            f"# The replica core vs the same vLLM engine stepped bare ({result['date']})", "",
            f"Command: `{result['command']}`", "",
            f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, vllm {m['vllm']}; "
            f"dtype {m['cpu_dtype_auto']}, {args.threads} engine threads, max_num_seqs {args.max_num_seqs}.", "",
            f"{args.requests} chat requests x {args.max_tokens} tokens ("
            + ("greedy" if args.temperature == 0 else
               f"sampled at temperature {args.temperature:g}, the core's CPU sampler {args.cpu_sampler}")
            + "".join(f", {k} {v:g}" for k, v in filters.items())
            + ", ignore_eos: decode speed), "
            f"{args.rounds} rounds, order alternated. Core: ReplicaCore.generate with telemetry "
            f"{'off' if args.no_telemetry else 'on'} (sampling control, pruning, π off); "
            "bare: LLMEngine.step in a loop. Our vLLM plugin "
            + ("loaded (both arms run our CPU attention backend)." if args.with_plugin else
               "not loaded (both arms run vLLM's CPU attention)."), "",
            "| round | bare tok/s | core tok/s | core / bare |", "|---|---|---|---|",
            *[f"| {i + 1} | {b:.1f} | {c:.1f} | {c / b:.2f} |" for i, (b, c) in
              enumerate(zip(result["rates"]["bare"], result["rates"]["core"]))],
            "", f"Median core / bare: {result['median_ratio']:.2f} (range {min(result['ratios']):.2f}-"
            f"{max(result['ratios']):.2f}).", ""])

    publish("loadtest.bench_core", argv, args.out,
            {"settings": vars(args), "rates": rates, "ratios": ratios, "median_ratio": st.median(ratios)}, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
