"""Benchmark: cost of entropy-stabilized sampling against plain vLLM, same prompts, same run.

Three configurations, interleaved over several rounds so machine noise hits all alike:
  plain    vLLM's LLMEngine as shipped (no logits processor)
  observe  our engine: entropy telemetry per token, sampling untouched (control off)
  control  our engine: telemetry plus the temperature law (control on)
Each round runs one batch of ``--batch`` requests (``--max-tokens`` tokens each, ignore_eos,
so every configuration generates the same number of tokens). Reported: decode throughput,
TTFT, inter-token latency, end-to-end latency (medians over rounds), their ratios to plain,
and the estimator's share of engine step time (median over steps).

    make bench ARGS="--batch 16 --rounds 3"      (writes docs/benchmarks/sampling.{md,json})
"""
from __future__ import annotations

import argparse
import statistics as st
import sys
import time

from controller.laws.entropic_time import EntropyTrace

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "List some tips for learning a new language.",
    "Describe the city of Paris to a tourist.",
    "What are the benefits of regular exercise?",
    "Write a poem about the ocean.",
    "Summarize the history of the printing press.",
    "How does a refrigerator keep food cold?",
]


def _run_batch(engine, make_params, prompts, processor=None) -> dict:
    tokenizer = engine.get_tokenizer()
    start = time.perf_counter()
    arrivals, first, last, gaps, traces, emitted = {}, {}, {}, [], {}, {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}-{time.monotonic_ns()}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=False)
        engine.add_request(rid, {"prompt_token_ids": tokenizer.encode(ids, add_special_tokens=False)},
                           make_params(rid, i))
        arrivals[rid] = time.perf_counter()
    steps, estimator_shares, tokens, step_times = 0, [], 0, []
    while engine.has_unfinished_requests():
        est0 = processor.estimator_seconds if processor else 0.0
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        steps += 1
        if all(len(o.outputs[0].token_ids) <= 1 for o in outputs) and len(outputs) == len(prompts):
            step_times.append(t1 - t0)  # a pure decode step of the full batch
        if processor is not None and t1 > t0:
            estimator_shares.append((processor.estimator_seconds - est0) / (t1 - t0))
        for out in outputs:
            new = len(out.outputs[0].token_ids)
            if not new:
                continue
            tokens += new
            rid = out.request_id
            if processor is not None:  # the telemetry work the worker does per delivered delta
                trace = traces.setdefault(rid, EntropyTrace())
                done = emitted.get(rid, 0)
                for h, _ in processor.records(rid)[done:done + new]:
                    trace.add(h)
                emitted[rid] = done + new
                if out.finished:
                    processor.forget(rid)
            if rid in last:
                gaps.append((t1 - last[rid]) / new)
            else:
                first[rid] = t1 - arrivals[rid]
            last[rid] = t1
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps,
            "ttft_s": st.median(first.values()), "itl_s": st.median(gaps) if gaps else 0.0,
            "e2e_s": st.median(last[r] - arrivals[r] for r in last),
            "decode_step_s": st.median(step_times) if step_times else 0.0,
            "estimator_share": st.median(estimator_shares) if estimator_shares else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="default")
    parser.add_argument("--estimator", default="exact", choices=["exact", "topk", "tail"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/benchmarks/sampling")
    args = parser.parse_args(argv)

    from workers.engine import configure_process_env

    configure_process_env(args.threads, 2)
    from vllm import EngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    from loadtest.machine import publish
    from workers.control_params import SamplingControl
    from workers.engine import find_logits_processor
    from workers.model_store import resolve_model
    from workers.sampling import EXTRA_ARGS_KEY, EntropicLogitsProcessor

    model = str(resolve_model(args.model))
    import torch

    from workers.hardware import resolve_dtype

    common = dict(model=model, enforce_eager=True, max_model_len=2048, max_num_seqs=args.batch, seed=0,
                  disable_log_stats=True, dtype=resolve_dtype("auto", torch.cuda.is_available()))
    plain = LLMEngine.from_engine_args(EngineArgs(**common))
    ours = LLMEngine.from_engine_args(EngineArgs(logits_processors=[EntropicLogitsProcessor], **common))
    processor = find_logits_processor(ours, EntropicLogitsProcessor)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]

    def params(control: SamplingControl | None):
        def make(rid: str, i: int) -> SamplingParams:
            extra = {EXTRA_ARGS_KEY: control.engine_args(rid, 1.0)} if control else None
            return SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=i,
                                  output_kind=RequestOutputKind.DELTA, extra_args=extra)
        return make

    configs = {
        "plain": (plain, params(None), None),
        "observe": (ours, params(SamplingControl(enabled=False, estimator=args.estimator)), processor),
        "control": (ours, params(SamplingControl(enabled=True, estimator=args.estimator)), processor),
    }
    for name, (engine, make, proc) in configs.items():  # warm-up, not measured
        _run_batch(engine, make, prompts[:2], proc)
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate: no config always goes first
            engine, make, proc = configs[name]
            rounds[name].append(_run_batch(engine, make, prompts, proc))
            print(f"round {r + 1}/{args.rounds} {name:8s} {rounds[name][-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr)

    def med(name: str, key: str) -> float:
        return st.median(x[key] for x in rounds[name])

    keys = ("tokens_per_s", "ttft_s", "itl_s", "e2e_s", "decode_step_s", "estimator_share")
    summary = {name: {k: med(name, k) for k in keys} for name in configs}

    def paired(name: str, key: str) -> float:
        # Ratio within each round (same minute of machine noise), then the median over rounds.
        return st.median(x[key] / p[key] for x, p in zip(rounds[name], rounds["plain"]))

    ratios = {name: {"throughput": paired(name, "tokens_per_s"), "e2e_latency": paired(name, "e2e_s"),
                     "itl": paired(name, "itl_s"), "decode_step": paired(name, "decode_step_s")}
              for name in configs if name != "plain"}
    publish("loadtest.bench_sampling", argv, args.out,
            {"settings": vars(args), "dtype": common["dtype"], "median": summary, "ratio_to_plain": ratios,
             "rounds": rounds}, _markdown)
    return 0


def _markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        "# Entropy-stabilized sampling vs plain vLLM", "",
        f"Command: `{result['command']}` (run {result['date']})", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; "
        f"torch {m['torch']}, vllm {m['vllm']}; {s['threads']} engine threads, dtype {result['dtype']}.", "",
        f"Batch {s['batch']} requests x {s['max_tokens']} tokens (ignore_eos), estimator `{s['estimator']}`, "
        f"medians over {s['rounds']} interleaved rounds (order rotated each round); ratios to plain are taken within each round, then the median.", "",
        "| configuration | tokens/s | throughput vs plain | decode step (ms) | step vs plain | TTFT (s) | ITL (ms) "
        "| e2e (s) | e2e vs plain | estimator share of step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    one = {"throughput": 1.0, "e2e_latency": 1.0, "decode_step": 1.0}
    for name, row in result["median"].items():
        ratio = result["ratio_to_plain"].get(name, one)
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {ratio['throughput']:.3f} | "
                     f"{1e3 * row['decode_step_s']:.1f} | {ratio['decode_step']:.3f} | {row['ttft_s']:.3f} | "
                     f"{1e3 * row['itl_s']:.1f} | {row['e2e_s']:.2f} | {ratio['e2e_latency']:.3f} | "
                     f"{100 * row['estimator_share']:.2f}% |")
    lines += ["", "Goal (issue): sampling control costs <= 3% throughput at batch 16; estimator <= 2% of step time.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
