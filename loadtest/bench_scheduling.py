"""Benchmark: FCFS (plain vLLM) vs π(s) scheduling under open-loop Poisson arrivals above capacity.

Same seeded arrival trace and prompts for both policies, interleaved over rounds, each replayed
against a ``workers.core.ReplicaCore`` (the replica that serves, without Ray) as OpenAI chat requests:
  fcfs  the scheduling layer off: vLLM's own first-come-first-served scheduler
  pi    the scheduling layer on: our EntropicScheduler, π(s) from each request's entropy profile
        computed by the replica's own control step (no controller: its local fallback)
Sampling control and pruning are off in both; telemetry (the entropy of every token) runs in both.
Workload: short chat questions, long-context questions (~1.5K-token passage), free-form
generation. Greedy decoding with ignore_eos, so both policies produce the same tokens (checked).
Reported per policy: mean and p99 end-to-end latency, mean TTFT, goodput (requests finished
within their class SLO per second), with ratios to FCFS.

    make bench-scheduling ARGS="--rate 1.2 --requests 60 --rounds 2"   (writes docs/results/scheduling.*)
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics as st
import sys
import time
from dataclasses import dataclass

from loadtest.machine import cpu_text
from loadtest.stats import percentile

FILLER = ("The committee met on a grey morning to review the harbour accounts, the repairs to the north pier "
          "and the schedule of the autumn ferries. ")
CLASSES = {  # name: (share, slo seconds, max_tokens)
    "chat": (0.5, 6.0, 24),
    "long_context": (0.2, 12.0, 12),
    "free_form": (0.3, 30.0, 128),
}


@dataclass
class Job:
    rid: str
    kind: str
    arrival: float
    prompt: str
    max_tokens: int


def make_trace(n: int, rate: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    names = list(CLASSES)
    weights = [CLASSES[k][0] for k in names]
    for i in range(n):
        t += rng.expovariate(rate)
        kind = rng.choices(names, weights)[0]
        if kind == "chat":
            prompt = f"In one sentence, what is {rng.choice(['a comet', 'rain', 'a violin', 'bread', 'a glacier'])}?"
        elif kind == "long_context":
            prompt = FILLER * 45 + f"Question {i}: what did the committee review first? Answer briefly."
        else:
            prompt = f"Write a long story about {rng.choice(['a lighthouse', 'a fox', 'a train', 'a garden'])}."
        jobs.append(Job(f"{kind}-{i}", kind, t, prompt, CLASSES[kind][2]))
    return jobs


async def run_policy(core, jobs: list[Job]) -> dict:
    """Replay the trace against one replica core: each job is sent at its arrival time, as an OpenAI
    chat request, through ``ReplicaCore.generate`` (the path a served request takes)."""
    from deployments.protocol import EntropicChatCompletionRequest

    scheduler = core.runner.scheduler
    def counters() -> tuple[int, int]:  # cumulative on our scheduler; vLLM's own has neither
        return getattr(scheduler, "priority_preemptions", 0), getattr(scheduler, "withheld_steps", 0)

    counted = counters()
    start = time.monotonic()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}

    async def one(job: Job) -> None:
        await asyncio.sleep(max(0.0, start + job.arrival - time.monotonic()))
        request = EntropicChatCompletionRequest(messages=[{"role": "user", "content": job.prompt}],
                                                max_tokens=job.max_tokens, temperature=0, ignore_eos=True)
        out: list[int] = []
        async for delta in core.generate("chat", request):
            if delta.token_ids and job.rid not in first:
                first[job.rid] = time.monotonic() - start
            out += delta.token_ids
        done[job.rid] = time.monotonic() - start
        tokens[job.rid] = out

    await asyncio.gather(*(one(job) for job in jobs))
    wall = time.monotonic() - start
    by_id = {j.rid: j for j in jobs}
    after = counters()
    return {**latency_stats([(by_id[r].kind, done[r] - by_id[r].arrival, first[r] - by_id[r].arrival) for r in done],
                            wall),
            "preemptions": after[0] - counted[0], "withheld_steps": after[1] - counted[1], "tokens": tokens}


def latency_stats(rows: list[tuple[str, float, float]], wall: float) -> dict:
    """One run's figures from (class, e2e s, TTFT s) per finished request."""
    lat = sorted(e2e for _, e2e, _ in rows)
    good = sum(1 for kind, e2e, _ in rows if e2e <= CLASSES[kind][1])
    return {"wall_s": wall, "mean_e2e_s": st.mean(lat), "p99_e2e_s": percentile(lat, 0.99),
            "mean_ttft_s": st.mean(t for _, _, t in rows), "goodput_rps": good / wall, "within_slo": good / len(rows),
            "per_class_mean_e2e_s": {k: st.mean(e for c, e, _ in rows if c == k)
                                     for k in CLASSES if any(c == k for c, _, _ in rows)}}


def median_summary(results: dict[str, list[dict]], keys: tuple[str, ...]) -> dict:
    """Per policy: the median over rounds of each figure, per-class latencies included."""
    summary = {n: {k: st.median(x[k] for x in xs) for k in keys} for n, xs in results.items()}
    for n, xs in results.items():
        summary[n]["per_class_mean_e2e_s"] = {c: st.median(x["per_class_mean_e2e_s"][c] for x in xs)
                                              for c in xs[0]["per_class_mean_e2e_s"]}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1.2, help="Poisson arrival rate, requests/s")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preempt-margin", type=float, default=None,
                        help="enable priority preemption with this π ratio (default: the config's, off)")
    parser.add_argument("--alpha", type=float, default=None, help="override scheduling.alpha")
    parser.add_argument("--delta", type=float, default=None,
                        help="override scheduling.delta (remaining-work weight; 0: the paper's π)")
    parser.add_argument("--grant-slots", type=int, default=None,
                        help="decode-step grants for the π policy: leases for this many sequences per control period")
    parser.add_argument("--out", default="docs/results/scheduling")
    args = parser.parse_args(argv)

    from controller.config import SchedulingConfig
    from loadtest.machine import publish
    from workers.config import EngineConfig, ReplicaConfig
    from workers.control_params import PruningControl, SamplingControl
    from workers.core import ReplicaCore

    overrides = {k: v for k, v in (("preempt_margin", args.preempt_margin), ("alpha", args.alpha),
                                   ("delta", args.delta), ("grant_slots", args.grant_slots)) if v is not None}
    scheduling = SchedulingConfig(**overrides)

    def core(name: str, scheduling_on: bool) -> ReplicaCore:
        # Only the scheduling layer differs between the two: sampling control and pruning are off in both
        # (greedy requests, ~1.5K-token prompts), telemetry runs in both, as it does when serving.
        config = ReplicaConfig(
            engine=EngineConfig(max_model_len=4096, max_num_seqs=args.max_num_seqs, cpu_threads=args.threads,
                                kv_cache_space_gib=2),
            sampling=SamplingControl(enabled=False), pruning=PruningControl(enabled=False),
            scheduling=scheduling.model_copy(update={"enabled": scheduling_on}))
        return ReplicaCore(config, replica_id=name, metrics_registry=CollectorRegistry())

    from prometheus_client import CollectorRegistry

    cores = {"fcfs": core("fcfs", False), "pi": core("pi", True)}
    jobs = make_trace(args.requests, args.rate, args.seed)
    warm = make_trace(3, 100.0, 99)

    results: dict[str, list[dict]] = {"fcfs": [], "pi": []}
    order = ["fcfs", "pi"]

    async def rounds() -> None:
        for c in cores.values():
            c.start()
            await run_policy(c, warm)
        for r in range(args.rounds):
            for name in order[r % 2:] + order[:r % 2]:
                results[name].append(await run_policy(cores[name], jobs))
                x = results[name][-1]
                print(f"round {r + 1}/{args.rounds} {name:4s} mean e2e {x['mean_e2e_s']:.2f}s p99 {x['p99_e2e_s']:.2f}s "
                      f"goodput {x['goodput_rps']:.3f}/s", file=sys.stderr)

    asyncio.run(rounds())

    same = [sum(a["tokens"][k] == b["tokens"][k] for k in a["tokens"]) / len(a["tokens"])
            for a, b in zip(results["fcfs"], results["pi"])]
    keys = ("mean_e2e_s", "p99_e2e_s", "mean_ttft_s", "goodput_rps", "within_slo", "wall_s", "preemptions",
            "withheld_steps")
    summary = median_summary(results, keys)
    ratios = {k: summary["pi"][k] / summary["fcfs"][k] for k in ("mean_e2e_s", "p99_e2e_s", "mean_ttft_s", "goodput_rps")}
    publish("loadtest.bench_scheduling", argv, args.out,
            {"settings": vars(args), "scheduling": scheduling.model_dump(), "classes": CLASSES, "median": summary,
             "ratio_pi_to_fcfs": ratios,
             "identical_output_fraction": same,
             "rounds": {n: [{k: v for k, v in x.items() if k != "tokens"} for x in xs] for n, xs in results.items()}},
            _markdown)
    return 0


def _markdown(result: dict) -> str:
    m, s, med, ratio = result["machine"], result["settings"], result["median"], result["ratio_pi_to_fcfs"]
    lines = [
        "# π(s) scheduling vs FCFS (the scheduling layer off: vLLM's own scheduler) under Poisson arrivals", "",
        f"Command: `{result['command']}` (run {result['date']})", "",
        f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; torch {m['torch']}, "
        f"vllm {m['vllm']}; {s['threads']} engine threads, max_num_seqs {s['max_num_seqs']}.", "",
        f"{s['requests']} requests at {s['rate']} req/s (seed {s['seed']}); classes (share, SLO s, max tokens): "
        + ", ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in result["classes"].items())
        + f". Medians over {s['rounds']} rounds (order alternated). Identical greedy output per round: "
        + ", ".join(f"{100 * x:.0f}%" for x in result["identical_output_fraction"]) + ".", "",
        "| policy | mean e2e (s) | p99 e2e (s) | mean TTFT (s) | goodput (req/s within SLO) | within SLO "
        "| priority preemptions |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in med.items():
        lines.append(f"| {name} | {row['mean_e2e_s']:.2f} | {row['p99_e2e_s']:.2f} | {row['mean_ttft_s']:.2f} | "
                     f"{row['goodput_rps']:.3f} | {100 * row['within_slo']:.0f}% | {row['preemptions']:.0f} |")
    if "scheduling" in result:
        w = result["scheduling"]
        lines += ["", f"π weights: α {w['alpha']}, β {w['beta']}, γ {w['gamma']}, δ (remaining work) "
                  f"{w.get('delta', 0.0)}, aging {w['aging_s']} s, priority preemption margin {w['preempt_margin']}, "
                  f"decode-step grant slots {w.get('grant_slots')} (lease {w.get('grant_lease_steps')} steps)."]
    lines += ["", f"π / FCFS: mean e2e {ratio['mean_e2e_s']:.3f}, p99 e2e {ratio['p99_e2e_s']:.3f}, "
              f"mean TTFT {ratio['mean_ttft_s']:.3f}, goodput {ratio['goodput_rps']:.3f}.", "",
              "Per class mean e2e (s): " + "; ".join(
                  f"{c}: fcfs {med['fcfs']['per_class_mean_e2e_s'][c]:.2f}, pi {med['pi']['per_class_mean_e2e_s'][c]:.2f}"
                  for c in med["fcfs"]["per_class_mean_e2e_s"]), "",
              "Goal (issue): mean latency <= 0.85x and goodput >= 1.15x vs FCFS at equal output.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
