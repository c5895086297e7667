"""Benchmark: cost of entropy-stabilized sampling against plain vLLM, same prompts, same run.

Three configurations, each a ``workers.core.ReplicaCore`` (the replica that serves, without Ray)
driven with the same OpenAI chat requests, interleaved over rounds so machine noise hits all alike:
  plain    ``telemetry: false``: vLLM's engine as shipped (no logits processor of ours)
  observe  entropy telemetry per token, sampling untouched (control off)
  control  telemetry plus the temperature law (the requests' ``entropic.enabled``)
Scheduling and pruning are off in all three. Each round runs one batch of ``--batch`` requests
(``--max-tokens`` tokens each, ignore_eos: a decode-speed benchmark, every configuration generates
as many tokens). Reported: throughput, TTFT, inter-token latency, end-to-end latency (medians over
rounds), their ratios to plain, the mean engine step and the estimator's share of step time
(from the replica's own ``entropic_engine_step_seconds`` / ``entropic_estimator_seconds``).

    make bench ARGS="--batch 16 --rounds 3"      (writes docs/results/sampling.{md,json})
"""
from __future__ import annotations

import argparse
import asyncio
import statistics as st
import sys
import time

from loadtest.machine import cpu_text

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


def _step_totals(core) -> tuple[float, float, float]:
    """(engine steps, their seconds, estimator seconds in them), cumulative, from the replica's own metrics."""
    totals = {s.name: s.value for m in core.metrics.registry.collect() for s in m.samples
              if s.name in ("entropic_engine_step_seconds_count", "entropic_engine_step_seconds_sum",
                            "entropic_estimator_seconds_sum")}
    return (totals.get("entropic_engine_step_seconds_count", 0.0), totals.get("entropic_engine_step_seconds_sum", 0.0),
            totals.get("entropic_estimator_seconds_sum", 0.0))


async def _run_batch(core, prompts: list[str], max_tokens: int, overrides: dict | None) -> dict:
    """One batch, all requests at once, through ``ReplicaCore.generate`` (chat requests, temperature 1,
    ignore_eos so every configuration generates as many tokens)."""
    from deployments.protocol import EntropicChatCompletionRequest

    before = _step_totals(core)
    start = time.perf_counter()
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    gaps: list[float] = []
    counts: dict[int, int] = {}

    async def one(i: int, prompt: str) -> None:
        request = EntropicChatCompletionRequest(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                                temperature=1.0, ignore_eos=True, seed=i)
        async for delta in core.generate("chat", request, overrides):
            now = time.perf_counter()
            new = len(delta.token_ids)
            if not new:
                continue
            counts[i] = counts.get(i, 0) + new
            if i in last:
                gaps.append((now - last[i]) / new)
            else:
                first[i] = now - start
            last[i] = now

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    steps, step_s, estimator_s = (a - b for a, b in zip(_step_totals(core), before))
    tokens = sum(counts.values())
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps,
            "ttft_s": st.median(first.values()), "itl_s": st.median(gaps) if gaps else 0.0,
            "e2e_s": st.median(t - start for t in last.values()),
            "mean_step_s": step_s / steps if steps else 0.0,
            "estimator_share": estimator_s / step_s if step_s else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="default")
    parser.add_argument("--estimator", default="exact", choices=["exact", "topk", "tail"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="docs/results/sampling")
    args = parser.parse_args(argv)

    from prometheus_client import CollectorRegistry

    from controller.config import SchedulingConfig
    from loadtest.machine import publish
    from workers.config import EngineConfig, ReplicaConfig
    from workers.control_params import PruningControl, SamplingControl
    from workers.core import ReplicaCore

    def core(name: str, telemetry: bool) -> ReplicaCore:
        config = ReplicaConfig(
            model=args.model, telemetry=telemetry,
            engine=EngineConfig(max_model_len=2048, max_num_seqs=args.batch, cpu_threads=args.threads),
            sampling=SamplingControl(enabled=False, estimator=args.estimator), pruning=PruningControl(enabled=False),
            scheduling=SchedulingConfig(enabled=False))  # only the sampling layer is measured
        return ReplicaCore(config, replica_id=name, metrics_registry=CollectorRegistry())

    plain, ours = core("plain", False), core("ours", True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    configs = {"plain": (plain, None), "observe": (ours, None), "control": (ours, {"enabled": True})}
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    names = list(configs)

    async def run() -> None:
        for c in (plain, ours):
            c.start()
        for c, overrides in configs.values():  # warm-up, not measured
            await _run_batch(c, prompts[:2], args.max_tokens, overrides)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate: no config always goes first
                c, overrides = configs[name]
                rounds[name].append(await _run_batch(c, prompts, args.max_tokens, overrides))
                print(f"round {r + 1}/{args.rounds} {name:8s} {rounds[name][-1]['tokens_per_s']:.1f} tok/s",
                      file=sys.stderr)

    asyncio.run(run())

    def med(name: str, key: str) -> float:
        return st.median(x[key] for x in rounds[name])

    keys = ("tokens_per_s", "ttft_s", "itl_s", "e2e_s", "mean_step_s", "estimator_share")
    summary = {name: {k: med(name, k) for k in keys} for name in configs}

    def paired(name: str, key: str) -> float:
        # Ratio within each round (same minute of machine noise), then the median over rounds.
        return st.median(x[key] / p[key] for x, p in zip(rounds[name], rounds["plain"]))

    ratios = {name: {"throughput": paired(name, "tokens_per_s"), "e2e_latency": paired(name, "e2e_s"),
                     "itl": paired(name, "itl_s"), "mean_step": paired(name, "mean_step_s")}
              for name in configs if name != "plain"}
    dtype = plain.runner.engine.model_config.dtype
    publish("loadtest.bench_sampling", argv, args.out,
            {"settings": vars(args), "dtype": str(dtype), "median": summary, "ratio_to_plain": ratios,
             "rounds": rounds}, _markdown)
    return 0


def _markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        "# Entropy-stabilized sampling vs plain vLLM", "",
        f"Command: `{result['command']}` (run {result['date']})", "",
        f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; "
        f"torch {m['torch']}, vllm {m['vllm']}; {s['threads']} engine threads, dtype {result['dtype']}.", "",
        f"Batch {s['batch']} requests x {s['max_tokens']} tokens (ignore_eos), estimator `{s['estimator']}`, "
        f"medians over {s['rounds']} interleaved rounds (order rotated each round); ratios to plain are taken "
        "within each round, then the median.", "",
        "| configuration | tokens/s | throughput vs plain | mean step (ms) | step vs plain | TTFT (s) | ITL (ms) "
        "| e2e (s) | e2e vs plain | estimator share of step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    one = {"throughput": 1.0, "e2e_latency": 1.0, "mean_step": 1.0}
    for name, row in result["median"].items():
        ratio = result["ratio_to_plain"].get(name, one)
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {ratio['throughput']:.3f} | "
                     f"{1e3 * row['mean_step_s']:.1f} | {ratio['mean_step']:.3f} | {row['ttft_s']:.3f} | "
                     f"{1e3 * row['itl_s']:.1f} | {row['e2e_s']:.2f} | {ratio['e2e_latency']:.3f} | "
                     f"{100 * row['estimator_share']:.2f}% |")
    lines += ["", "Goal (issue): sampling control costs <= 3% throughput at batch 16; estimator <= 2% of step time.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
