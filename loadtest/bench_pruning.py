"""Decode throughput with entropic KV pruning vs plain vLLM, by context length and block size.

Each engine runs in its own process, one after the other on the same machine, inside a
``workers.core.ReplicaCore`` (the replica that serves, without Ray) driven with OpenAI completion
requests (greedy, ignore_eos: a decode-speed benchmark):
* ``plain``: stock vLLM (``VLLM_PLUGINS`` names none of ours: vLLM's own CPU attention; the
  replica's ``telemetry: false``: no logits processor of ours);
* ``pruned``: the replica with pruning on (our backend from the entry point, entropy telemetry),
  the deployment's pruning budget, or with ``--keep`` a kept fraction fixed through the request's
  ``entropic.pruning`` (what the fidelity tests use). Sampling control and scheduling are off.

Per context length, batch ``--batch`` rows share one prompt prefix (distinct last line, so
greedy rows differ), or with ``--prompts distinct`` each row opens with a line of its own, so no
two rows share a KV block, as served prompts do not; the prompts are prefilled once (warm-up) so
both engines decode from the same prefix-cache state. Decode rate = batch * (N - 1) /
(t(N tokens) - t(1 token)), the median of ``--reps`` repetitions. The pruned process also
reports blocks kept, attention FLOPs and KV bytes per generated token (analytic dense figures
minus what the backend skipped) and block-selection time per step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from loadtest.machine import cpu_text

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def filler_prompts(tokenizer, context: int, batch: int, distinct: bool = False) -> list[str]:
    """``batch`` prompts of about ``context`` tokens. Shared: one body and a distinct last line, so the rows'
    full KV blocks are the same physical blocks (vLLM's prefix cache), which every row's attention then reads.
    Distinct: each row's first line differs, so no block is shared: the memory traffic of distinct requests."""
    per = len(tokenizer.encode(FILLER, add_special_tokens=False))
    body = FILLER * max(1, (context - 40) // per)
    return [f"{f'Document {i}. ' if distinct else ''}{body}\nQuestion {i}: what colour is the sky? Answer:"
            for i in range(batch)]


def add_prompt_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", choices=["shared", "distinct"], default="shared",
                        help="rows share one prompt prefix (as published runs) or share no KV block (as served)")


def keep_overrides(keep: float | None) -> dict | None:
    """A request's ``entropic`` overrides that fix its kept fraction from the first decode step; None: the
    deployment's budget."""
    if keep is None:
        return None
    return {"pruning": {"budget": "fixed", "keep_min": keep}}


async def run_batch(core, prompts: list[str], max_tokens: int, overrides: dict | None) -> None:
    from deployments.protocol import EntropicCompletionRequest

    async def one(prompt: str) -> None:
        request = EntropicCompletionRequest(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for _ in core.generate("completion", request, overrides):
            pass

    await asyncio.gather(*(one(p) for p in prompts))


async def _measure(core, args) -> dict:
    from workers.pruning_state import STATE

    pruned = args.worker == "pruned"
    overrides = keep_overrides(args.keep) if pruned else None
    config = core.runner.engine.vllm_config.model_config.hf_config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    layers = config.num_hidden_layers
    itemsize = core.runner.engine.vllm_config.model_config.dtype.itemsize  # of the KV cache too (its dtype: auto)
    tokenizer = core.runner.tokenizer
    STATE.fused_selection = args.selection == "fused"
    core.start()
    results = []
    for context in args.contexts:
        prompts = filler_prompts(tokenizer, context, args.batch, args.prompts == "distinct")
        tokens = len(tokenizer.encode(prompts[0]))
        await run_batch(core, prompts, 1, overrides)  # warm the prefix cache
        rates = []
        before = vars(STATE.stats).copy()
        for _ in range(args.reps):
            t0 = time.perf_counter()
            await run_batch(core, prompts, 1, overrides)
            t1 = time.perf_counter()
            await run_batch(core, prompts, args.new_tokens, overrides)
            t2 = time.perf_counter()
            rates.append(args.batch * (args.new_tokens - 1) / ((t2 - t1) - (t1 - t0)))
        after = vars(STATE.stats)
        decode_tokens = args.reps * args.batch * (args.new_tokens - 1)
        dense_flops = 4 * heads * head_dim * tokens * layers
        dense_bytes = 2 * kv_heads * head_dim * itemsize * tokens * layers
        total = after["blocks_total"] - before["blocks_total"]
        row = {"context": context, "prompt_tokens": tokens, "decode_tok_s": statistics.median(rates), "rates": rates,
               "kept_ratio": (after["blocks_kept"] - before["blocks_kept"]) / total if total else 1.0,
               "attn_flops_per_token": dense_flops - (after["attention_flops_saved"] - before["attention_flops_saved"])
               / decode_tokens,
               "kv_bytes_per_token": dense_bytes - (after["kv_bytes_saved"] - before["kv_bytes_saved"]) / decode_tokens,
               "selection_ms_per_step": 1e3 * (after["selection_seconds"] - before["selection_seconds"])
               / (args.reps * (args.new_tokens - 1) * 2)}
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {"results": results}


def make_core(kind: str, *, model: str, batch: int, block_size: int, threads: int, kv_gib: int,
              dtype: str = "float32", logits_processors: tuple[type, ...] = (), decode_kernel: bool = True):
    """One replica core: ``plain`` is vLLM as shipped (``telemetry: false``, and the process was started
    with ``plain_env``), ``pruned`` the served configuration with pruning on; ``logits_processors``: a
    benchmark's instruments (loadtest.instruments); ``decode_kernel``: ``engine.decode_kernel``."""
    from prometheus_client import CollectorRegistry

    from controller.config import SchedulingConfig
    from workers.config import EngineConfig, ReplicaConfig
    from workers.control_params import PruningControl, SamplingControl
    from workers.core import ReplicaCore

    pruned = kind == "pruned"
    config = ReplicaConfig(
        model=model, telemetry=pruned,
        engine=EngineConfig(max_model_len=8192, max_num_seqs=batch, block_size=block_size, dtype=dtype,
                            cpu_threads=threads, kv_cache_space_gib=kv_gib, decode_kernel=decode_kernel),
        sampling=SamplingControl(enabled=False), pruning=PruningControl(enabled=pruned),
        scheduling=SchedulingConfig(enabled=False))
    return ReplicaCore(config, replica_id=kind, metrics_registry=CollectorRegistry(),
                       logits_processors=logits_processors)


def add_core_arguments(parser: argparse.ArgumentParser, dtype: str) -> None:
    """The replica core's settings (``make_core``'s) that a tool's command line takes and hands its workers."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=4)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default=dtype, help="the engine's dtype (auto: as `make serve` picks it)")
    parser.add_argument("--decode-kernel", choices=["on", "off"], default="on",
                        help="the pruned arm's pure-decode steps on our decode kernel where it runs (as served), "
                             "or on vLLM's CPU attention")


def core_argv(args: argparse.Namespace) -> list[str]:
    """``add_core_arguments``' values, as a worker's command line takes them."""
    return ["--threads", str(args.threads), "--kv-gib", str(args.kv_gib), "--model", args.model, "--dtype", args.dtype,
            "--decode-kernel", args.decode_kernel]


def core_dtype(core) -> str:
    """The dtype the core's engine resolved (``auto`` becomes bf16 or float32 by the CPU's flags)."""
    return str(core.runner.engine.vllm_config.model_config.dtype).removeprefix("torch.")


def arm_order(round_index: int) -> tuple[str, str]:
    """The order of the two arms' processes in a round: plain first in even rounds, pruned first in odd ones."""
    return ("plain", "pruned") if round_index % 2 == 0 else ("pruned", "plain")


def plain_env() -> dict[str, str]:
    """The environment of a ``plain`` process: no general plugin of ours, so vLLM's own CPU attention."""
    return {**os.environ, "VLLM_PLUGINS": "none-of-ours"}


def worker(args) -> dict:
    core = make_core(args.worker, model=args.model, batch=args.batch, block_size=args.block_size,
                     threads=args.threads, kv_gib=args.kv_gib, dtype=args.dtype,
                     decode_kernel=args.decode_kernel == "on")
    return {"dtype": core_dtype(core), **asyncio.run(_measure(core, args))}


def _run_worker(kind: str, block_size: int, args) -> dict:
    env = plain_env() if kind == "plain" else dict(os.environ)
    cmd = [sys.executable, "-m", "loadtest.bench_pruning", "--worker", kind, "--block-size", str(block_size),
           "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
           *core_argv(args), "--selection", args.selection, "--prompts", args.prompts,
           "--contexts", *map(str, args.contexts)]
    if args.keep is not None:
        cmd += ["--keep", str(args.keep)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def kept_ceiling(bound: float, kept: float) -> float:
    """The speed ratio of a step whose attention costs ``kept`` of the dense attention and nothing more.

    With the plain step P = rest + A and bound = P / rest, the step rest + kept * A is
    P / (rest + kept * A) = 1 / (1 / bound + kept * (1 - 1 / bound)): of the bound's gain it reaches
    (1 - kept) * rest / (rest + kept * A), which is below 1 - kept at any context.
    """
    return 1.0 / (1.0 / bound + kept * (1.0 - 1.0 / bound))


def _render(result: dict) -> str:
    m = result["machine"]
    lines = [f"# KV pruning benchmark: plain vLLM vs entropic pruning ({result['date']})", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; "
             f"torch {m['torch']}, vllm {m['vllm']}; {result.get('dtype', 'float32')}.", "",
             f"Batch {result['batch']}, {result['new_tokens']} new tokens, median of {result['reps']} repetitions "
             f"x {result.get('rounds', 1)} alternating plain/pruned process pairs, pruning setting: {result['setting']}. "
             "Bound: the ratio if attention cost nothing (plain rate at the shortest context / plain rate here). "
             "Ceiling: the ratio if attention cost the kept fraction of the dense one and nothing else were added "
             "(`kept_ceiling`); on vLLM's attention kernel, a pruned step cannot reach more than 1 - kept of the "
             "bound's gain (our decode kernel, where it runs, reads kept blocks faster and can).", "",
             "| block | context | plain tok/s | pruned tok/s | ratio | bound | ceiling at kept | kept "
             "| attn FLOPs/tok (pruned/dense) | KV MB/tok (pruned/dense) | selection ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        bound = ceiling = "-"
        if "attention_free_bound" in r:
            bound = f"{r['attention_free_bound']:.2f}x"
            ceiling = f"{kept_ceiling(r['attention_free_bound'], r['kept_ratio']):.2f}x"
        lines.append(f"| {r['block_size']} | {r['prompt_tokens']} | {r['plain_tok_s']:.1f} | {r['pruned_tok_s']:.1f} | "
                     f"{r['ratio']:.2f}x | {bound} | {ceiling} | {r['kept_ratio']:.2f} | "
                     f"{r['attn_flops_pruned'] / 1e6:.0f}M / "
                     f"{r['attn_flops_dense'] / 1e6:.0f}M | {r['kv_bytes_pruned'] / 1e6:.1f} / "
                     f"{r['kv_bytes_dense'] / 1e6:.1f} | {r['selection_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["plain", "pruned"])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096, 7168])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=2, help="repetitions per context in each process")
    parser.add_argument("--rounds", type=int, default=2, help="plain/pruned process pairs per block size")
    parser.add_argument("--keep", type=float, default=None, help="fixed keep fraction; default: the deployment's budget")
    parser.add_argument("--selection", choices=["fused", "torch"], default="fused",
                        help="block selection: the fused C op (serving default) or the torch path")
    add_prompt_argument(parser)
    add_core_arguments(parser, dtype="float32")  # as its published runs
    parser.add_argument("--out", default="docs/results/pruning")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    from loadtest.machine import publish

    rows = []
    dtypes: set[str] = set()
    for block_size in args.block_sizes:
        runs = []
        for r in range(args.rounds):
            # plain and pruned processes alternate, and which goes first alternates too: on this shared machine
            # the second process of a pair ran slower more often than not (docs/results/pruning-profile-short.md)
            done = {kind: _run_worker(kind, block_size, args) for kind in arm_order(r)}
            runs.append((done["plain"], done["pruned"]))
        dtypes.update(run["dtype"] for pair in runs for run in pair)
        rounds = [(plain["results"], pruned["results"]) for plain, pruned in runs]
        short_plain = None
        for i, context in enumerate(args.contexts):
            a_rates = [r for plain, _ in rounds for r in plain[i]["rates"]]
            b_rates = [r for _, pruned in rounds for r in pruned[i]["rates"]]
            a, b = rounds[0][0][i], rounds[0][1][i]
            plain_rate, pruned_rate = statistics.median(a_rates), statistics.median(b_rates)
            short_plain = short_plain or plain_rate
            rows.append({"block_size": block_size, "context": context, "prompt_tokens": a["prompt_tokens"],
                         "plain_tok_s": plain_rate, "pruned_tok_s": pruned_rate, "ratio": pruned_rate / plain_rate,
                         # a step with free attention is at best as fast as the shortest context's step
                         "attention_free_bound": short_plain / plain_rate,
                         "kept_ratio": statistics.mean(p[i]["kept_ratio"] for _, p in rounds),
                         "attn_flops_dense": a["attn_flops_per_token"], "attn_flops_pruned": b["attn_flops_per_token"],
                         "kv_bytes_dense": a["kv_bytes_per_token"], "kv_bytes_pruned": b["kv_bytes_per_token"],
                         "selection_ms": statistics.median(p[i]["selection_ms_per_step"] for _, p in rounds),
                         "plain_rates": a_rates, "pruned_rates": b_rates})
    setting = "deployment default law" if args.keep is None else f"keep {args.keep} from the first decode step"
    setting += f", {args.selection} block selection, {args.prompts} prompts, {args.threads} engine thread(s)"
    if args.decode_kernel == "off":
        setting += ", vLLM's attention kernel in every step"
    publish("loadtest.bench_pruning", argv, args.out,
            {"batch": args.batch, "new_tokens": args.new_tokens, "reps": args.reps, "rounds": args.rounds,
             "setting": setting, "dtype": "/".join(sorted(dtypes)), "rows": rows},
            _render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
