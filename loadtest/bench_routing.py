"""Benchmark: request routing across two worker replicas, Serve's power-of-two router vs ours.

The whole application runs as it is served (Ray Serve on this machine, two EntropicWorker replicas,
the controller, the HTTP ingress); only ``request_router`` differs:
  power_of_two    Serve's default router (two random replicas, the shorter queue)
  soonest_served  deployments.routing.SoonestServedRouter, ranking replicas from the controller's
                  view (free slots first, then the time until a slot frees from the remaining work
                  of the running sequences)
Same seeded open-loop Poisson trace and prompts as the scheduling benchmark (short chat,
long-context questions, free-form generation), sent over HTTP with the official OpenAI client,
streamed so TTFT is measured at the client. Greedy with ignore_eos, so both routers produce the
same tokens unless batch composition changes a float tie (reported). Rounds alternate the order.

    make bench-routing ARGS="--rate 0.55 --requests 60 --rounds 3"   (writes docs/results/routing.*)

Two replicas with one engine thread each on the 2-core machine finish about 0.5 requests/s of this mix.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from loadtest.bench_scheduling import CLASSES, Job, latency_stats, make_trace, median_summary
from loadtest.machine import cpu_text
from loadtest.served_app import ServedApp, replay

ROUTERS = ("power_of_two", "soonest_served")


async def _one(client, model: str, job: Job, start: float) -> dict:
    await asyncio.sleep(max(0.0, job.arrival - (time.monotonic() - start)))
    sent = time.monotonic() - start
    first, text = None, []
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": job.prompt}], max_tokens=job.max_tokens, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.monotonic() - start
            text.append(chunk.choices[0].delta.content)
    done = time.monotonic() - start
    return {"rid": job.rid, "kind": job.kind, "arrival": job.arrival, "sent": sent, "ttft": (first or done) - job.arrival,
            "e2e": done - job.arrival, "text": "".join(text)}


async def run_trace(base: str, jobs: list[Job]) -> dict:
    rows, wall = await replay(base, jobs, _one)
    return {**latency_stats([(r["kind"], r["e2e"], r["ttft"]) for r in rows], wall),
            "max_send_lag_s": max(r["sent"] - r["arrival"] for r in rows),
            "texts": {r["rid"]: r["text"] for r in rows}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=0.55, help="Poisson arrival rate, requests/s")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fcfs", action="store_true",
                        help="replicas schedule first come first served (scheduling.enabled false) instead of by π")
    parser.add_argument("--out", default="docs/results/routing")
    args = parser.parse_args(argv)

    from loadtest.machine import publish

    jobs = make_trace(args.requests, args.rate, args.seed)
    results: dict[str, list[dict]] = {r: [] for r in ROUTERS}
    with ServedApp(args.max_num_seqs) as app:
        for r in range(args.rounds):
            for router in ROUTERS[r % 2:] + ROUTERS[:r % 2]:
                x = app.measure({"request_router": router, "scheduling": {"enabled": not args.fcfs}},
                                lambda base: run_trace(base, jobs))
                results[router].append(x)
                print(f"round {r + 1}/{args.rounds} {router:14s} mean e2e {x['mean_e2e_s']:.2f}s "
                      f"p99 {x['p99_e2e_s']:.2f}s TTFT {x['mean_ttft_s']:.2f}s goodput {x['goodput_rps']:.3f}/s "
                      f"split {x['split']}", file=sys.stderr)

    a, b = ROUTERS
    same = [sum(x["texts"][k] == y["texts"][k] for k in x["texts"]) / len(x["texts"])
            for x, y in zip(results[a], results[b])]
    keys = ("mean_e2e_s", "p99_e2e_s", "mean_ttft_s", "goodput_rps", "within_slo", "wall_s", "max_send_lag_s")
    summary = median_summary(results, keys)
    ratios = {k: summary[b][k] / summary[a][k] for k in ("mean_e2e_s", "p99_e2e_s", "mean_ttft_s", "goodput_rps")}
    publish("loadtest.bench_routing", argv, args.out,
            {"settings": vars(args), "classes": CLASSES, "median": summary, "ratio_soonest_to_pow2": ratios,
             "identical_output_fraction": same,
             "rounds": {n: [{k: v for k, v in x.items() if k != "texts"} for x in xs] for n, xs in results.items()}},
            _markdown)
    return 0


def _markdown(result: dict) -> str:
    m, s, med, ratio = result["machine"], result["settings"], result["median"], result["ratio_soonest_to_pow2"]
    lines = [
        "# Routing across two replicas: Serve's power-of-two vs soonest-served (controller view)", "",
        f"Command: `{result['command']}` (run {result['date']})", "",
        f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; torch {m['torch']}, "
        f"vllm {m['vllm']}. Ray Serve on this machine: two worker replicas (1 engine thread each, "
        f"max_num_seqs {s['max_num_seqs']}, {'FCFS' if s.get('fcfs') else 'π'} scheduling), controller, HTTP "
        "ingress; requests over HTTP (streamed).", "",
        f"{s['requests']} requests at {s['rate']} req/s (seed {s['seed']}); classes (share, SLO s, max tokens): "
        + ", ".join(f"{k} {v[0]}/{v[1]}/{v[2]}" for k, v in result["classes"].items())
        + f". Fresh replicas per run; medians over {s['rounds']} rounds (order alternated). Identical greedy output "
        "per round: " + ", ".join(f"{100 * x:.0f}%" for x in result["identical_output_fraction"]) + ".", "",
        "| router | mean e2e (s) | p99 e2e (s) | mean TTFT (s) | goodput (req/s within SLO) | within SLO | "
        "requests per replica (each round) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in med.items():
        splits = "; ".join("/".join(f"{v:.0f}" for v in x["split"]) for x in result["rounds"][name])
        lines.append(f"| {name} | {row['mean_e2e_s']:.2f} | {row['p99_e2e_s']:.2f} | {row['mean_ttft_s']:.2f} | "
                     f"{row['goodput_rps']:.3f} | {100 * row['within_slo']:.0f}% | {splits} |")
    lines += ["", f"soonest_served / power_of_two: mean e2e {ratio['mean_e2e_s']:.3f}, p99 e2e {ratio['p99_e2e_s']:.3f}, "
              f"mean TTFT {ratio['mean_ttft_s']:.3f}, goodput {ratio['goodput_rps']:.3f}.", "",
              "Per class mean e2e (s): " + "; ".join(
                  f"{c}: power_of_two {med['power_of_two']['per_class_mean_e2e_s'][c]:.2f}, "
                  f"soonest_served {med['soonest_served']['per_class_mean_e2e_s'][c]:.2f}"
                  for c in med["power_of_two"]["per_class_mean_e2e_s"]), "",
              f"Largest client send lag behind the trace: {max(r['max_send_lag_s'] for r in med.values()):.2f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
