"""Benchmark: the controller's cluster-wide queue and dispatch against Serve's router, on the served app.

The whole application runs as it is served (Ray Serve on this machine, two EntropicWorker replicas, the
controller, the HTTP ingress); configurations differ only in how requests are placed and ordered:
  A  Serve's power-of-two router, vLLM's FCFS scheduler in each replica (what a Ray Serve LLM user runs)
  B  Serve's power-of-two router, π in each replica (scheduling on, dispatch off: today's default)
  C  the controller's queue: requests wait there, highest π first, until a replica has a free slot
     (dispatch on), π in each replica
  D  C with π's entropy terms off (every request's expected entropy drop is the prior, and the
     remaining-work predictor has no entropy features): what entropy adds
  M  B with migration: requests waiting unstarted on one replica move to one that can start them sooner
     (M/B: what moving waiting work saves; each run records how many moved)
  E  B with π's entropy terms off (the replicas' π and the controller's predictor without entropy)
  S  B with shortest remaining work first instead of π (``scheduling.objective: srpt``: π's remaining-work
     term alone, aged, with the same predictor): E/B and S/B say what entropy and the rest of π add to
     remaining work alone (issue 14, item 2)
  O  C told every request's output length: its max_tokens is the length the same request reached in the
     latest run of a configuration not told (greedy, so the same output), which makes "max_tokens minus
     generated" exact and the predictor picks it. An oracle, to measure the ceiling of prediction: O/A is
     what C could reach with a perfect remaining-work predictor on this trace, O/C what prediction error
     costs. Not the first configuration listed (its first run needs an earlier one's lengths)
  P  O with shortest remaining work first in the queue and the replicas (``objective: srpt``): the ordering
     that minimizes mean latency on one server, with exact lengths; not listed first either
Same seeded open-loop Poisson trace as the scheduling and routing benchmarks (short chat, long-context
questions, free-form writing), sent over HTTP with the official OpenAI client, streamed so TTFT is
measured at the client. Greedy, and every output ends at EOS or at a loose max_tokens (``LOOSE_MAX_TOKENS``,
well above what the chat and long-context answers need): no output length is known in advance, so
π's remaining-work term sees max_tokens, not the true length. Rounds alternate the order of the
configurations; each run gets fresh replicas.

    make bench-dispatch ARGS="--rate 0.6 --requests 60 --rounds 2"   (writes docs/results/dispatch.*)
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import statistics as st
import sys
import time
from pathlib import Path

from loadtest.bench_scheduling import CLASSES, Job, latency_stats, make_trace
from loadtest.machine import cpu_text
from loadtest.served_app import ServedApp, replay
from loadtest.stats import percentile

LOOSE_MAX_TOKENS = {"chat": 256, "long_context": 128, "free_form": 512}
CONFIGS = {
    "A": {"request_router": "power_of_two", "scheduling": {"enabled": False}, "dispatch": {"enabled": False}},
    "B": {"request_router": "power_of_two", "scheduling": {"enabled": True}, "dispatch": {"enabled": False}},
    "C": {"request_router": "power_of_two", "scheduling": {"enabled": True}, "dispatch": {"enabled": True}},
    "D": {"request_router": "power_of_two", "scheduling": {"enabled": True, "entropy_terms": False},
          "dispatch": {"enabled": True}},
    "M": {"request_router": "power_of_two", "scheduling": {"enabled": True}, "dispatch": {"enabled": False},
          "migration": {"enabled": True}},
    "E": {"request_router": "power_of_two", "scheduling": {"enabled": True, "entropy_terms": False},
          "dispatch": {"enabled": False}},
    "S": {"request_router": "power_of_two", "scheduling": {"enabled": True, "objective": "srpt"},
          "dispatch": {"enabled": False}},
    "O": {"request_router": "power_of_two", "scheduling": {"enabled": True}, "dispatch": {"enabled": True}},
    "P": {"request_router": "power_of_two", "scheduling": {"enabled": True, "objective": "srpt"},
          "dispatch": {"enabled": True}},
}
ORACLE = frozenset({"O", "P"})  # configurations whose requests carry their known output length as max_tokens
DEFAULT_CONFIGS = ["A", "B", "C", "D"]
LABELS = {"A": "A: power-of-two, FCFS", "B": "B: power-of-two, π", "C": "C: controller queue, π",
          "D": "D: C without entropy terms", "M": "M: B with migration", "E": "E: B without entropy terms",
          "S": "S: B with shortest remaining work first", "O": "O: C told each output's length (oracle)",
          "P": "P: O, shortest remaining work first"}
KEYS = ("mean_e2e_s", "p50_e2e_s", "p99_e2e_s", "mean_ttft_s", "mean_tpot_s", "goodput_rps", "within_slo",
        "shed", "wall_s", "max_send_lag_s")


async def _one(client, model: str, job: Job, start: float, max_tokens: int | None = None) -> dict:
    await asyncio.sleep(max(0.0, job.arrival - (time.monotonic() - start)))
    sent = time.monotonic() - start
    first, chunks = None, 0
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": job.prompt}],
            max_tokens=max_tokens or LOOSE_MAX_TOKENS[job.kind],
            temperature=0, stream=True, stream_options={"include_usage": True})
        tokens = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic() - start
                chunks += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # shed (503) or failed: counted, not timed
        return {"rid": job.rid, "kind": job.kind, "error": type(exc).__name__, "sent": sent, "arrival": job.arrival}
    done = time.monotonic() - start
    ttft = (first or done) - job.arrival
    return {"rid": job.rid, "kind": job.kind, "arrival": job.arrival, "sent": sent, "ttft": ttft,
            "e2e": done - job.arrival, "tokens": tokens,
            "tpot": (done - job.arrival - ttft) / (tokens - 1) if tokens > 1 else None}


async def run_trace(base: str, jobs: list[Job], lengths: dict[str, int] | None = None) -> dict:
    """The trace against ``base``; ``lengths`` (the oracle's): each request's max_tokens, by request id."""
    lengths = lengths or {}

    async def one(client, model: str, job: Job, start: float) -> dict:
        return await _one(client, model, job, start, lengths.get(job.rid))

    rows, wall = await replay(base, jobs, one)
    served = [r for r in rows if "error" not in r]
    e2e = [r["e2e"] for r in served]
    tpots = [r["tpot"] for r in served if r["tpot"] is not None]
    return {**latency_stats([(r["kind"], r["e2e"], r["ttft"]) for r in served], wall),
            "p50_e2e_s": st.median(e2e), "mean_tpot_s": st.mean(tpots) if tpots else 0.0,
            "shed": len(rows) - len(served), "errors": sorted({r["error"] for r in rows if "error" in r}),
            "output_tokens": {r["rid"]: r["tokens"] for r in served},
            "e2e_by_request": {r["rid"]: r["e2e"] for r in served},
            "ttft_by_request": {r["rid"]: r["ttft"] for r in served},
            "max_send_lag_s": max(r["sent"] - r["arrival"] for r in rows)}


def decision_cost(queued: int, replicas: int, repeats: int = 200) -> dict:
    """Seconds the controller spends deciding its whole queue once (``Dispatcher.decide``) with ``queued``
    requests waiting on ``replicas`` full replicas: what bounds its decisions per second. In-process, the
    code that serves, with reports built here."""
    from prometheus_client import CollectorRegistry

    from controller.config import DispatchConfig, SchedulingConfig
    from controller.dispatcher import Dispatcher
    from controller.laws.priority import SequenceState
    from controller.laws.routing import ReplicaLoad
    from controller.messages import Admission, TelemetryReport

    async def run() -> list[float]:
        d = Dispatcher(DispatchConfig(enabled=True, max_queued=queued + 1), SchedulingConfig(), CollectorRegistry())
        state = SequenceState(expected_drop=0.3, attended_tokens=100, kv_blocks=2, waited_s=0, slo_s=30)
        for r in range(replicas):
            d.observe(TelemetryReport(
                replica_id=f"r{r}", node_id="n", sent_at=time.time(), sequences={f"s{r}-{i}": state for i in range(16)},
                summaries={}, load=ReplicaLoad(running=16, waiting=0, max_num_seqs=16, step_s=0.05, unit_step_s=0.03),
                routing_stats_polls=0, leases=None, kv_free_tokens=10_000, kv_total_tokens=100_000, finished={}))
        for i in range(queued):
            d.enqueue(Admission(key=f"q{i}", prompt_tokens=100 + i, max_tokens=64 + i, max_wait_s=600))
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            d.decide()
            times.append(time.perf_counter() - started)
        return times

    times = asyncio.run(run())
    return {"queued": queued, "replicas": replicas, "median_s": st.median(times), "p90_s": percentile(times, 0.9)}


def _moved(base: str) -> float:
    """Requests the replicas handed back for another replica in this run (migration; 0 when off)."""
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("entropic_requests_ended_early_total{") and 'reason="moved"' in line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=0.6, help="Poisson arrival rate, requests/s")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="per replica")
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/results/dispatch")
    parser.add_argument("--replot", action="store_true", help="measure nothing: draw the plots of the saved "
                        "<out>.json and rewrite <out>.md with them")
    args = parser.parse_args(argv)
    if args.configs[0] in ORACLE:
        parser.error(f"{args.configs[0]} takes its output lengths from an earlier run: list another configuration first")
    if args.replot:
        from loadtest.plots import replot

        replot(args.out, lambda result, path: plot(result["rounds"], path), _markdown)
        return 0

    import httpx

    from loadtest.machine import publish

    costs = [decision_cost(q, r) for q, r in ((16, 2), (256, 2), (256, 16), (1024, 64))]
    print(f"decision cost: {costs}", file=sys.stderr, flush=True)
    jobs = make_trace(args.requests, args.rate, args.seed)
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    lengths: dict[str, int] = {}  # each request's output length in the latest run that was not told it
    with ServedApp(args.max_num_seqs) as app:
        for r in range(args.rounds):
            order = args.configs[r % len(args.configs):] + args.configs[:r % len(args.configs)]
            for name in order:
                told = dict(lengths) if name in ORACLE else None
                x = app.measure(CONFIGS[name], functools.partial(run_trace, jobs=jobs, lengths=told))
                if told is None:
                    lengths = dict(x["output_tokens"])
                else:  # greedy outputs can still differ between batch mixes: count the requests the oracle missed
                    x["oracle_missed"] = sum(x["output_tokens"].get(rid) != n for rid, n in told.items())
                base = x.pop("base")
                view = httpx.get(f"{base}/debug/dispatch", timeout=30).json()
                x["moved"] = _moved(base)
                x["remaining_work"] = (view.get("controller") or {}).get("remaining_work")
                x["admissions"] = view["admissions"]  # by outcome: how many the controller placed, shed or missed
                results[name].append(x)
                print(f"round {r + 1}/{args.rounds} {name} mean e2e {x['mean_e2e_s']:.2f}s p99 {x['p99_e2e_s']:.2f}s "
                      f"TTFT {x['mean_ttft_s']:.2f}s goodput {x['goodput_rps']:.3f}/s shed {x['shed']} "
                      f"split {x['split']}", file=sys.stderr, flush=True)

    summary = {n: {k: st.median(x[k] for x in xs) for k in KEYS} for n, xs in results.items()}
    ratios = {}
    for a, b in (("C", "A"), ("C", "B"), ("D", "C"), ("B", "A"), ("M", "B"), ("E", "B"), ("S", "B"), ("S", "A"),
                 ("O", "A"), ("O", "C"), ("P", "A")):
        if a in results and b in results:
            ratios[f"{a}/{b}"] = {k: [x[k] / y[k] if y[k] else None for x, y in zip(results[a], results[b])]
                                  for k in ("mean_e2e_s", "p99_e2e_s", "mean_ttft_s", "goodput_rps")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    plots = plot(results, Path(args.out))
    publish("loadtest.bench_dispatch", argv, args.out,
            {"settings": vars(args), "classes": CLASSES, "loose_max_tokens": LOOSE_MAX_TOKENS, "configs": CONFIGS,
             "median": summary, "ratios": ratios, "decision_cost": costs, "plots": plots,
             "rounds": {n: [{k: v for k, v in x.items() if k != "output_tokens"} | {
                 "mean_output_tokens": st.mean(x["output_tokens"].values()) if x["output_tokens"] else 0}
                 for x in xs] for n, xs in results.items()}},
            _markdown)
    return 0


def plot(results: dict[str, list[dict]], out: Path) -> list[str]:
    """Latency CDFs per configuration (end to end and TTFT), every served request of every round pooled."""
    from loadtest.plots import cdf, save_figure

    def draw(key: str):
        def each_config(ax) -> None:
            for name, xs in results.items():
                if all(x.get(key) for x in xs):
                    cdf(ax, [v for x in xs for v in x[key].values()], LABELS[name])
        return each_config

    return [save_figure(out, "e2e-cdf", "End-to-end latency per configuration", "end-to-end latency (s)",
                        "fraction of requests", draw("e2e_by_request")),
            save_figure(out, "ttft-cdf", "Time to first token per configuration", "TTFT (s)",
                        "fraction of requests", draw("ttft_by_request"))]


def _markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        "# Dispatch: the controller's cluster-wide queue vs Serve's router, on the served app", "",
        f"Command: `{result['command']}` (run {result['date']})", "",
        f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; torch {m['torch']}, "
        f"vllm {m['vllm']}. Ray Serve on this machine: two worker replicas (1 engine thread each, max_num_seqs "
        f"{s['max_num_seqs']}), controller, HTTP ingress; requests over HTTP (streamed).", "",
        f"{s['requests']} requests at {s['rate']} req/s (seed {s['seed']}), greedy, outputs end at EOS or at a loose "
        "max_tokens (" + ", ".join(f"{k} {v}" for k, v in result["loose_max_tokens"].items()) + "); SLO per class: "
        + ", ".join(f"{k} {v[1]} s" for k, v in result["classes"].items())
        + f". Fresh replicas per run; medians over {s['rounds']} rounds (order rotated).", "",
        "Configurations: " + "; ".join(f"{k}: `{v}`" for k, v in result["configs"].items() if k in result["median"]), "",
        "| config | mean e2e (s) | p50 e2e | p99 e2e | mean TTFT | mean TPOT (ms) | goodput (req/s in SLO) | "
        "within SLO | shed | requests per replica (each round) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["median"].items():
        splits = "; ".join("/".join(f"{v:.0f}" for v in x["split"]) for x in result["rounds"][name])
        lines.append(f"| {name} | {row['mean_e2e_s']:.2f} | {row['p50_e2e_s']:.2f} | {row['p99_e2e_s']:.2f} | "
                     f"{row['mean_ttft_s']:.2f} | {1000 * row['mean_tpot_s']:.0f} | {row['goodput_rps']:.3f} | "
                     f"{100 * row['within_slo']:.0f}% | {row['shed']:.0f} | {splits} |")
    lines += ["", "Ratios per round (median [min-max]):", ""]
    for pair, by_metric in result["ratios"].items():
        cells = []
        for metric, values in by_metric.items():
            vals = [v for v in values if v is not None]
            if vals:
                cells.append(f"{metric} {st.median(vals):.2f}x [{min(vals):.2f}-{max(vals):.2f}]")
        lines.append(f"- {pair}: " + ", ".join(cells))
    lines += ["", "The controller deciding its whole queue once (`Dispatcher.decide`, all replicas full, in-process): "
              + "; ".join(f"{c['queued']} queued x {c['replicas']} replicas: {1e6 * c['median_s']:.0f} µs median "
                          f"({1e6 * c['p90_s']:.0f} p90)" for c in result["decision_cost"]) + ".", ""]
    lines += ["", "Remaining-work predictor at the end of each run (model in use; held-out mean absolute error in "
              "tokens of the budget, max_tokens minus generated, and of the fitted models; finished requests it "
              "learnt from, warm-up included):", ""]
    for n, xs in result["rounds"].items():
        for i, x in enumerate(xs):
            rw = x.get("remaining_work") or {}
            errors = ", ".join(f"{k} {v:.0f}" for k, v in rw.get("held_out_mae_tokens", {}).items())
            placed = ", ".join(f"{k} {v:.0f}" for k, v in (x.get("admissions") or {}).items() if v)
            lines.append(f"- {n} round {i + 1}: {rw.get('model')} ({errors or 'too few held-out samples'}; "
                         f"{rw.get('finished_requests')} finished); admissions by outcome: "
                         f"{placed or 'none (dispatch off)'}; requests moved: {x.get('moved', 0):.0f}"
                         + (f"; outputs whose length differed from the one told: {x['oracle_missed']}"
                            if "oracle_missed" in x else ""))
    if result.get("plots"):
        lines += ["", "Latency CDFs, every request of every round:", ""] + [
            f"![{Path(p).stem}]({Path(p).name})" for p in result["plots"]]
    lines += ["", "Mean end-to-end latency per class, seconds (each round): " + "; ".join(
        f"{n}: " + ", ".join(f"{c} " + "/".join(f"{x['per_class_mean_e2e_s'][c]:.1f}" for x in xs)
                             for c in xs[0].get("per_class_mean_e2e_s", {}))
        for n, xs in result["rounds"].items())]
    lines += ["", "Mean output tokens per request (each round): " + "; ".join(
        f"{n}: " + ", ".join(f"{x['mean_output_tokens']:.0f}" for x in xs) for n, xs in result["rounds"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
