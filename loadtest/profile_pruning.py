"""Where a pruned decode step's time goes, against plain vLLM's step (issue: speed, item 2).

    make profile-pruning ARGS="--contexts 3900 6900 --batches 8 16 --rounds 2"

The same replica cores and workload as ``make bench-pruning`` (``plain``: vLLM as shipped, our plugin not
loaded; ``pruned``: the served configuration with pruning on, by default a kept fraction fixed at 0.25 from
the first decode step), each in a process of its own, alternating over rounds, which goes first too. Per
context length and batch the rows share one prompt prefix (with ``--prompts distinct``, no KV block), warmed
once; then a 1-token and an N-token batch run, and every figure is (what the N-token run took - what the
1-token run took) / (N - 1): one decode step, the prefill of each row's last line taken out.

Wall-clock timers wrap the functions of the step that are ours or that pruning changes (a perf_counter pair
per call, ~1 µs, against steps of tens of milliseconds):

* ``attention``: vLLM's CPU attention (``CPUAttentionBackendImpl.forward``; the cache write is an op of its own),
  every layer, or our decode kernel (``kernels.cpu_decode_attention``) in the pure-decode steps it takes;
* ``selection``: choosing each pruned layer's blocks (``_compacted_table``) without the key summaries;
* ``summaries``: per-block key summaries computed for blocks that have none yet (C kernel or torch path);
* ``layer wrapper``: the rest of our per-layer ``forward`` (the metadata copy, the plan lookup);
* ``plan``: the once-per-step pruning plan (K per row, compacted lengths) in the metadata builder;
* ``logits processor``: our entropy telemetry (only the pruned arm runs it: pruning reads entropy);
* ``rest``: everything else in the step (model weights, sampling, scheduling, Python), by difference.

Then the bound: with attention free, a step would take the plain step's ``rest``; with attention over the
kept fraction only and nothing added, ``rest + kept * attention``. The gap between that and the pruned step
is what our code and the kernel's shorter-but-scattered reads cost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics as st
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from loadtest.bench_pruning import (
    add_core_arguments,
    add_prompt_argument,
    arm_order,
    core_argv,
    core_dtype,
    filler_prompts,
    keep_overrides,
    make_core,
    plain_env,
    run_batch,
)

PARTS = ("attention", "selection", "summaries", "layer wrapper", "plan", "logits processor")


class Timers:
    """Seconds per part, accumulated by wrappers installed on the engine's classes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, part: str) -> None:
        original: Callable = getattr(owner, name)
        if isinstance(owner, type):
            original = owner.__dict__[name]  # the class's own function, not one it inherits

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - started

        setattr(owner, name, timed)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


def install(timers: Timers, pruned: bool) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    timers.wrap(CPUAttentionBackendImpl, "forward", "attention")
    if not pruned:
        return
    import workers.pruned_attention as pa
    from workers.pruning_plan import PrunedLayers, PruningPlanner
    from workers.sampling import EntropicLogitsProcessor

    timers.wrap(PrunedLayers, "forward", "layer total")
    timers.wrap(pa, "decode_attention", "attention")  # our kernel, in steps where it runs instead of vLLM's
    timers.wrap(pa.PrunedCPUAttentionBackendImpl, "_compacted_table", "selection total")
    # the C kernel, and the torch path where the kernel declines: one part
    timers.wrap(pa, "summarize_into", "summaries")
    timers.wrap(pa, "summarize_blocks", "summaries")
    timers.wrap(PruningPlanner, "_plan", "plan")
    timers.wrap(EntropicLogitsProcessor, "apply", "logits processor")


def per_step(before: dict[str, float], short: dict[str, float], long: dict[str, float], steps: int) -> dict[str, float]:
    """Seconds per decode step of each part: the long run's increase minus the short run's, over the steps."""
    parts = set(short) | set(long)
    out = {p: ((long.get(p, 0.0) - short.get(p, 0.0)) - (short.get(p, 0.0) - before.get(p, 0.0))) / steps
           for p in parts}
    if "layer total" in out:  # the pruned arm; a context too short to prune never selected
        out["selection"] = out.pop("selection total", 0.0) - out.get("summaries", 0.0)
        out["layer wrapper"] = (out.pop("layer total") - out.get("attention", 0.0) - out["selection"]
                                - out.get("summaries", 0.0))
    return out


async def _measure(core: Any, args: argparse.Namespace, timers: Timers) -> list[dict]:
    from workers.pruning_state import STATE

    pruned = args.worker == "pruned"
    overrides = keep_overrides(args.keep) if pruned else None
    tokenizer = core.runner.tokenizer
    core.start()
    # The first pruned steps of a process pay one-time costs (each layer's summary buffer, first calls):
    # measured once, a few tokens at the shortest context, so they land on no row
    distinct = args.prompts == "distinct"
    await run_batch(core, filler_prompts(tokenizer, min(args.contexts), min(args.batches), distinct), 4, overrides)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            prompts = filler_prompts(tokenizer, context, batch, distinct)
            await run_batch(core, prompts, 1, overrides)  # warm the prefix cache
            before = timers.snapshot()
            kept_before = (STATE.stats.blocks_kept, STATE.stats.blocks_total)
            t0 = time.perf_counter()
            await run_batch(core, prompts, 1, overrides)
            t1 = time.perf_counter()
            short = timers.snapshot()
            await run_batch(core, prompts, args.new_tokens, overrides)
            t2 = time.perf_counter()
            steps = args.new_tokens - 1
            parts = per_step(before, short, timers.snapshot(), steps)
            kept, total = STATE.stats.blocks_kept - kept_before[0], STATE.stats.blocks_total - kept_before[1]
            row = {"context": context, "prompt_tokens": len(tokenizer.encode(prompts[0])), "batch": batch,
                   "step_s": ((t2 - t1) - (t1 - t0)) / steps, "parts_s": parts,
                   "kept_ratio": kept / total if total else 1.0}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def worker(args: argparse.Namespace) -> dict:
    pruned = args.worker == "pruned"
    core = make_core(args.worker, model=args.model, batch=max(args.batches), block_size=args.block_size,
                     threads=args.threads, kv_gib=args.kv_gib, dtype=args.dtype,
                     decode_kernel=args.decode_kernel == "on")
    timers = Timers()
    install(timers, pruned)
    return {"dtype": core_dtype(core), "rows": asyncio.run(_measure(core, args, timers))}


def _run_worker(kind: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "loadtest.profile_pruning", "--worker", kind, "--block-size", str(args.block_size),
           "--new-tokens", str(args.new_tokens), *core_argv(args), "--keep", str(args.keep),
           "--prompts", args.prompts, "--contexts", *map(str, args.contexts), "--batches", *map(str, args.batches)]
    out = subprocess.run(cmd, env=plain_env() if kind == "plain" else None, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(rounds: list[dict[str, dict]]) -> list[dict]:
    """Medians over rounds, per (context, batch), and the bound each pruned step is measured against."""
    rows = []
    for i, first in enumerate(rounds[0]["plain"]["rows"]):
        plain = [r["plain"]["rows"][i] for r in rounds]
        pruned = [r["pruned"]["rows"][i] for r in rounds]

        def med(runs: list[dict], part: str | None = None) -> float:
            return st.median(x["step_s"] if part is None else x["parts_s"].get(part, 0.0) for x in runs)

        plain_step, plain_attention = med(plain), med(plain, "attention")
        kept = st.mean(x["kept_ratio"] for x in pruned)
        parts = {p: med(pruned, p) for p in PARTS}
        parts["rest"] = med(pruned) - sum(parts.values())
        rows.append({"context": first["context"], "prompt_tokens": first["prompt_tokens"], "batch": first["batch"],
                     "plain_step_s": plain_step, "plain_steps_s": [x["step_s"] for x in plain],
                     "plain_attention_s": plain_attention, "plain_rest_s": plain_step - plain_attention,
                     "pruned_step_s": med(pruned), "pruned_steps_s": [x["step_s"] for x in pruned],
                     "pruned_parts_s": parts, "kept_ratio": kept,
                     "bound_free_attention_s": plain_step - plain_attention,
                     "bound_kept_attention_s": plain_step - plain_attention + kept * plain_attention})
    return rows


def _render(result: dict) -> str:
    from loadtest.machine import header

    lines = header(result, "Where a pruned decode step's time goes", f"{result['dtype']}, block {result['block_size']}")
    lines += [f"Pruning: {result['setting']}; {result['new_tokens']} new tokens per run; medians of "
              f"{result['rounds']} alternating plain/pruned process pairs. Milliseconds per decode step "
              "(the whole batch). "
              + ("Each row's prompt has blocks of its own, as served prompts do."
                 if "distinct" in result["setting"] else
                 "Rows of a batch share one prompt prefix, as in `make bench-pruning`."), "",
              "| context | batch | plain step (attention + rest) | pruned step | " + " | ".join(PARTS) + " | rest | "
              "kept | bound: rest + kept x attention | pruned / plain speed | bound / plain speed |",
              "|" + "---|" * (len(PARTS) + 9)]

    def ms(seconds: float) -> str:
        return f"{1e3 * seconds:.1f}"

    for r in result["rows"]:
        p = r["pruned_parts_s"]
        lines.append(f"| {r['prompt_tokens']} | {r['batch']} | {ms(r['plain_step_s'])} ({ms(r['plain_attention_s'])} + "
                     f"{ms(r['plain_rest_s'])}) | {ms(r['pruned_step_s'])} | "
                     + " | ".join(ms(p[k]) for k in PARTS) + f" | {ms(p['rest'])} | {r['kept_ratio']:.2f} | "
                     f"{ms(r['bound_kept_attention_s'])} | {r['plain_step_s'] / r['pruned_step_s']:.2f}x | "
                     f"{r['plain_step_s'] / r['bound_kept_attention_s']:.2f}x |")
    lines += ["", "Per round, step ms (plain / pruned): " + "; ".join(
        f"{r['prompt_tokens']}x{r['batch']}: " + ", ".join(f"{ms(a)} / {ms(b)}" for a, b in
                                                          zip(r["plain_steps_s"], r["pruned_steps_s"], strict=True))
        for r in result["rows"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["plain", "pruned"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[3900, 6900])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", type=float, default=0.25, help="kept fraction, fixed from the first decode step")
    parser.add_argument("--block-size", type=int, default=64)
    add_core_arguments(parser, dtype="auto")
    add_prompt_argument(parser)
    parser.add_argument("--out", default="docs/results/pruning-profile")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    from loadtest.machine import publish

    rounds = []
    for r in range(args.rounds):
        rounds.append({kind: _run_worker(kind, args) for kind in arm_order(r)})
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    setting = f"keep {args.keep} from the first decode step, {args.prompts} prompts, {args.threads} engine thread(s)"
    if args.decode_kernel == "off":
        setting += ", vLLM's attention kernel in every step"
    publish("loadtest.profile_pruning", argv, args.out,
            {"dtype": rounds[0]["pruned"]["dtype"], "block_size": args.block_size, "new_tokens": args.new_tokens,
             "rounds": args.rounds, "setting": setting, "rows": summarize(rounds), "runs": rounds}, _render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
