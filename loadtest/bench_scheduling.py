"""Benchmark: FCFS (plain vLLM) vs π(s) scheduling under open-loop Poisson arrivals above capacity.

Same seeded arrival trace and prompts for both policies, interleaved over rounds:
  fcfs  vLLM's LLMEngine as shipped (first come, first served)
  pi    our EntropicScheduler + logits processor; π(s) from each request's entropy profile,
        recomputed every control period exactly as a replica's local fallback does
Workload: short chat questions, long-context questions (~1.5K-token passage), free-form
generation. Greedy decoding with ignore_eos, so both policies produce the same tokens (checked).
Reported per policy: mean and p99 end-to-end latency, mean TTFT, goodput (requests finished
within their class SLO per second), with ratios to FCFS.

    make bench-scheduling ARGS="--rate 1.2 --requests 60 --rounds 2"   (writes docs/benchmarks/scheduling.*)
"""
from __future__ import annotations

import argparse
import random
import statistics as st
import sys
import time
from dataclasses import dataclass

from controller.laws.priority import priorities
from workers.tracking import GrantBoard, PriorityBoard, SequenceTrack

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


def run_policy(engine, tokenizer, jobs: list[Job], pi_control: dict | None) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from workers.control_params import SamplingControl
    from workers.sampling import EXTRA_ARGS_KEY

    control = SamplingControl(enabled=False)
    scheduler = pi_control["scheduler"] if pi_control else None
    counted = (scheduler.priority_preemptions, scheduler.withheld_steps) if scheduler else (0, 0)  # cumulative
    pending = list(jobs)
    start = time.monotonic()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    tracks: dict[str, SequenceTrack] = {}
    next_control = 0.0
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0].arrival <= now:
            job = pending.pop(0)
            ids = tokenizer.encode(tokenizer.apply_chat_template(
                [{"role": "user", "content": job.prompt}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False)
            extra = {EXTRA_ARGS_KEY: control.engine_args(job.rid, 0.0)} if pi_control else None
            engine.add_request(job.rid, {"prompt_token_ids": ids}, SamplingParams(
                temperature=0, max_tokens=job.max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
                extra_args=extra))
            tracks[job.rid] = SequenceTrack(time.monotonic(), time.monotonic(), len(ids), CLASSES[job.kind][1],
                                            job.max_tokens)
            tokens[job.rid] = []
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, pending[0].arrival - now)) if pending else 0.0)
            continue
        if pi_control and now >= next_control:
            mono = time.monotonic()
            states = {k: t.state(mono, pi_control["prior_drop"], pi_control["block_size"])
                      for k, t in tracks.items() if k not in done}
            pis = priorities(states, pi_control["weights"])
            pi_control["board"].publish(pis)
            if pi_control["grants"] is not None:
                pi_control["grants"].renew(pis)
            next_control = now + pi_control["period"]
        for out in engine.step():
            t_out = time.monotonic() - start
            new = list(out.outputs[0].token_ids)
            if new and out.request_id not in first:
                first[out.request_id] = t_out
            tokens[out.request_id] += new
            if pi_control:
                records = pi_control["processor"].records(out.request_id)
                n = len(tokens[out.request_id])
                delta = TrackDelta(entropy=[h for h, _ in records[n - len(new):n]], token_ids=new, completion_tokens=n)
                tracks[out.request_id].observe(delta, time.monotonic(), pi_control["drop_ewma"])
            if out.finished:
                done[out.request_id] = t_out
                if pi_control:
                    pi_control["processor"].forget(out.request_id)
    wall = time.monotonic() - start
    by_id = {j.rid: j for j in jobs}
    return {**latency_stats([(by_id[r].kind, done[r] - by_id[r].arrival, first[r] - by_id[r].arrival) for r in done],
                            wall),
            "preemptions": scheduler.priority_preemptions - counted[0] if scheduler else 0,
            "withheld_steps": scheduler.withheld_steps - counted[1] if scheduler else 0,
            "tokens": tokens}


def latency_stats(rows: list[tuple[str, float, float]], wall: float) -> dict:
    """One run's figures from (class, e2e s, TTFT s) per finished request."""
    lat = sorted(e2e for _, e2e, _ in rows)
    good = sum(1 for kind, e2e, _ in rows if e2e <= CLASSES[kind][1])
    return {"wall_s": wall, "mean_e2e_s": st.mean(lat), "p99_e2e_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
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


@dataclass
class TrackDelta:
    """The fields of workers.engine.Delta that SequenceTrack.observe reads (benchmarks drive LLMEngine directly)."""

    entropy: list[float]
    token_ids: list[int]
    completion_tokens: int
    temperature: tuple = ()
    entropic_time: float = 0.0
    mean_entropy: float = 0.0


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
    parser.add_argument("--delta", type=float, default=None, help="override scheduling.delta (remaining-work weight; 0: the paper's π)")
    parser.add_argument("--grant-slots", type=int, default=None,
                        help="decode-step grants for the π policy: leases for this many sequences per control period")
    parser.add_argument("--out", default="docs/benchmarks/scheduling")
    args = parser.parse_args(argv)

    from workers.engine import configure_process_env

    configure_process_env(args.threads, 2)
    import torch
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from deployments.config import SchedulingConfig
    from loadtest.machine import publish
    from workers.engine import find_logits_processor
    from workers.hardware import resolve_dtype
    from workers.model_store import resolve_model
    from workers.sampling import EntropicLogitsProcessor

    common = dict(model=str(resolve_model("default")), enforce_eager=True, max_model_len=4096, seed=0,
                  max_num_seqs=args.max_num_seqs, disable_log_stats=True,
                  dtype=resolve_dtype("auto", torch.cuda.is_available()))
    fcfs = LLMEngine.from_engine_args(EngineArgs(**common))
    ours = LLMEngine.from_engine_args(EngineArgs(
        **common, logits_processors=[EntropicLogitsProcessor], scheduling_policy="priority",
        scheduler_cls="workers.scheduler.EntropicScheduler"))
    overrides = {k: v for k, v in (("preempt_margin", args.preempt_margin), ("alpha", args.alpha),
                                   ("delta", args.delta), ("grant_slots", args.grant_slots)) if v is not None}
    scheduling = SchedulingConfig(**overrides)
    scheduler = ours.engine_core.engine_core.scheduler
    scheduler.board = PriorityBoard()
    scheduler.grants = GrantBoard(scheduling.grant_policy()) if scheduling.grant_slots else None
    scheduler.preempt_margin = scheduling.preempt_margin
    pi_control = {"board": scheduler.board, "grants": scheduler.grants, "scheduler": scheduler, "weights": scheduling.weights(),
                  "prior_drop": scheduling.prior_drop, "drop_ewma": scheduling.drop_ewma, "period": 0.05,
                  "block_size": ours.vllm_config.cache_config.block_size,
                  "processor": find_logits_processor(ours, EntropicLogitsProcessor)}
    tokenizer = fcfs.get_tokenizer()
    jobs = make_trace(args.requests, args.rate, args.seed)
    warm = make_trace(3, 100.0, 99)
    run_policy(fcfs, tokenizer, warm, None)
    run_policy(ours, tokenizer, warm, pi_control)

    results: dict[str, list[dict]] = {"fcfs": [], "pi": []}
    order = ["fcfs", "pi"]
    for r in range(args.rounds):
        for name in order[r % 2:] + order[:r % 2]:
            engine, ctl = (fcfs, None) if name == "fcfs" else (ours, pi_control)
            results[name].append(run_policy(engine, tokenizer, jobs, ctl))
            x = results[name][-1]
            print(f"round {r + 1}/{args.rounds} {name:4s} mean e2e {x['mean_e2e_s']:.2f}s p99 {x['p99_e2e_s']:.2f}s "
                  f"goodput {x['goodput_rps']:.3f}/s", file=sys.stderr)

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
        "# π(s) scheduling vs FCFS (plain vLLM) under Poisson arrivals", "",
        f"Command: `{result['command']}` (run {result['date']})", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; torch {m['torch']}, "
        f"vllm {m['vllm']}; {s['threads']} engine threads, max_num_seqs {s['max_num_seqs']}.", "",
        f"{s['requests']} requests at {s['rate']} req/s (seed {s['seed']}); classes (share, SLO s, max tokens): "
        + ", ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in result["classes"].items())
        + f". Medians over {s['rounds']} rounds (order alternated). Identical greedy output per round: "
        + ", ".join(f"{100 * x:.0f}%" for x in result["identical_output_fraction"]) + ".", "",
        "| policy | mean e2e (s) | p99 e2e (s) | mean TTFT (s) | goodput (req/s within SLO) | within SLO | priority preemptions |",
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
