"""Time to first token at long prompts, arm by arm: where the replica's prefill time goes.

    make bench-prefill ARGS="--rounds 2"   (writes docs/results/prefill-split.{md,json})

``vllm bench serve`` measured our server's mean TTFT on ~3.9K-token prompts above ``vllm serve``'s. This
splits the engine-side causes from the serving path's: each arm is one fresh process holding one engine
built from the same ``EngineConfig`` (the shipped defaults: compiled, ``dtype: auto``, one engine thread,
max_num_seqs 16), given ``--requests`` prompts of ~``--tokens`` tokens of natural text (Python's documentation, a
different stretch each, so the prefix cache never helps; as bench-serve's natural set), each asking for
``--max-tokens`` tokens (greedy, ``ignore_eos``). All at once by default; with ``--concurrency C``,
closed-loop as ``vllm bench serve --max-concurrency C`` drives a server: C in flight, the next submitted
when one finishes, so prefill chunks of new requests share steps with the others' decodes. It records
each request's time to its first token from its own submission, the gaps between its tokens, and the
wall time of the batch. Arms:

* ``vllm``: vLLM's ``LLMEngine`` stepped bare, our plugin not loaded (vLLM's CPU attention, its default
  KV block size, FCFS, no logits processor of ours): the engine ``vllm serve`` runs;
* ``core``: ``workers.core.ReplicaCore`` as served (telemetry, sampling control, pruning with its KV block
  size, π scheduling), requests through ``ReplicaCore.generate``;
* ``core-block128``: ``core`` with vLLM's CPU default block size (128);
* ``core-fcfs``: ``core`` with scheduling off (vLLM's FCFS scheduler);
* ``core-plain``: ``core`` with telemetry off (vLLM's engine as shipped behind the core's request path);
* ``core-4k-pages``: ``core`` with torch's allocations on the kernel's default pages
  (``THP_MEM_ALLOC_ENABLE=0``, as in ``vllm serve`` and the ``vllm`` arm), whatever the replica's default;
  since the replica's default is those pages, the same run as ``core``: kept so that the commands published
  before that default rerun as they were, and left out of the default ``--arms``;
* ``core-huge-pages``: ``core`` with torch asking for transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``, a
  user's override of the replica's default, workers/engine.py).

Each arm also records how long its engine took to build and start (``start_s``: loading, compiling from the
cache, zeroing the KV cache).

No HTTP, no Serve: what is left between ``core`` and ``vllm serve``'s TTFT in bench-serve is the serving
path's. Arms alternate over rounds, one process at a time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.stats import percentile

ARMS = ("vllm", "core", "core-block128", "core-fcfs", "core-plain", "core-4k-pages", "core-huge-pages")
# Arms whose process sets torch's THP_MEM_ALLOC_ENABLE (the kernel's default pages as `vllm serve` has them, or
# huge pages) whatever the replica's default
_PAGES = {"vllm": "0", "core-4k-pages": "0", "core-huge-pages": "1"}
DEFAULT_ARMS = [arm for arm in ARMS if arm != "core-4k-pages"]  # the same run as core at the replica's default


def _config(arm: str):
    from controller.config import SchedulingConfig
    from workers.config import EngineConfig, ReplicaConfig

    engine = EngineConfig(block_size=128 if arm == "core-block128" else None)
    return ReplicaConfig(engine=engine, telemetry=arm != "core-plain",
                         scheduling=SchedulingConfig(enabled=arm != "core-fcfs"))


def run_arm(arm: str, prompts: list[str], max_tokens: int, concurrency: int | None = None) -> dict:
    """In this process: build the arm's engine, warm it, submit the prompts (``concurrency`` in flight;
    None: all at once), time each request's tokens."""
    if arm == "vllm":
        os.environ["VLLM_PLUGINS"] = "none-of-ours"  # before vLLM loads its plugins
    if arm in _PAGES:
        os.environ["THP_MEM_ALLOC_ENABLE"] = _PAGES[arm]  # a user's override of ours, before torch is imported
    from workers.engine import configure_process_env

    config = _config(arm)
    configure_process_env(config.engine.threads(), config.engine.kv_cache_space_gib)
    from workers.model_store import resolve_model

    model = str(resolve_model(config.model))
    if arm == "vllm":
        return _bare(config, model, prompts, max_tokens, concurrency)
    return _core(config, prompts, max_tokens, concurrency)


def _bare(config, model: str, prompts: list[str], max_tokens: int, concurrency: int | None) -> dict:
    from vllm import EngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    kwargs = {k: v for k, v in config.engine.engine_kwargs(model, config.model_name).items() if k != "logprobs_mode"}
    started = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs(**{**kwargs, "disable_log_stats": True}))
    start_s = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    def batch(tag: str, texts: list[str], limit: int) -> tuple[list[float], list[float], float]:
        start = time.perf_counter()
        pending = list(enumerate(texts))
        submitted: dict[str, float] = {}
        seen: dict[str, list[float]] = {}

        def submit() -> None:
            i, text = pending.pop(0)
            submitted[f"{tag}-{i}"] = time.perf_counter()
            engine.add_request(f"{tag}-{i}", text, params)

        while pending and len(submitted) < limit:
            submit()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids:
                    seen.setdefault(out.request_id, []).append(time.perf_counter())
                if out.finished and pending:
                    submit()
        return _ttft_gaps(submitted, seen) + (time.perf_counter() - start,)

    batch("warm", ["Warm up the engine."] * 2, 2)
    ttft, gaps, wall = batch("run", prompts, concurrency or len(prompts))
    return {"ttft_s": ttft, "gap_s": gaps, "wall_s": wall, "block_size": engine.vllm_config.cache_config.block_size,
            "start_s": start_s}


def _ttft_gaps(submitted: dict[str, float], seen: dict[str, list[float]]) -> tuple[list[float], list[float]]:
    """Each request's time to first token from its submission, and every gap between its tokens."""
    ttft = [seen[k][0] - t for k, t in submitted.items()]
    gaps = [b - a for times in seen.values() for a, b in zip(times, times[1:])]
    return ttft, gaps


def _core(config, prompts: list[str], max_tokens: int, concurrency: int | None) -> dict:
    import asyncio

    from prometheus_client import CollectorRegistry

    from deployments.protocol import EntropicCompletionRequest
    from workers.core import ReplicaCore

    started = time.perf_counter()
    core = ReplicaCore(config, replica_id="prefill", metrics_registry=CollectorRegistry())
    start_s = time.perf_counter() - started

    async def batch(texts: list[str], limit: int) -> tuple[list[float], list[float], float]:
        start = time.perf_counter()
        slots = asyncio.Semaphore(limit)
        submitted: dict[str, float] = {}
        seen: dict[str, list[float]] = {}

        async def one(key: str, text: str) -> None:
            async with slots:
                request = EntropicCompletionRequest(prompt=text, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                submitted[key] = time.perf_counter()
                async for _ in core.generate("completion", request):
                    seen.setdefault(key, []).append(time.perf_counter())

        await asyncio.gather(*(one(str(i), t) for i, t in enumerate(texts)))
        return _ttft_gaps(submitted, seen) + (time.perf_counter() - start,)

    async def run() -> tuple[list[float], list[float], float]:
        core.start()
        await batch(["Warm up the engine."] * 2, 2)
        return await batch(prompts, concurrency or len(prompts))

    ttft, gaps, wall = asyncio.run(run())
    block_size = core.block_size
    core.shutdown()
    return {"ttft_s": ttft, "gap_s": gaps, "wall_s": wall, "block_size": block_size, "start_s": start_s}


def p99(xs: list[float]) -> float:
    value = percentile(xs, 0.99)
    return float("nan") if value is None else value


def prompts_of(n: int, tokens: int) -> list[str]:
    from loadtest import bench_serve
    from workers.model_store import DEFAULT_MODEL, resolve_model

    path = Path(tempfile.mkdtemp(prefix="bench-prefill-")) / "natural.jsonl"
    bench_serve.natural_dataset(path, str(resolve_model(DEFAULT_MODEL)), n, tokens)
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=ARMS)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=3900)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, help="requests in flight, closed loop (default: all at once)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="docs/results/prefill-split")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # the child: run this arm, print JSON
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        prompts = json.loads(Path(args.prompts).read_text())
        print("RESULT " + json.dumps(run_arm(args.arm, prompts, args.max_tokens, args.concurrency)), flush=True)
        return 0

    from loadtest.machine import header, publish

    prompts_file = Path(tempfile.mkdtemp(prefix="bench-prefill-")) / "prompts.json"
    prompts_file.write_text(json.dumps(prompts_of(args.requests, args.tokens)))
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for r in range(args.rounds):
        order = args.arms if r % 2 == 0 else list(reversed(args.arms))
        for arm in order:
            out = subprocess.run([sys.executable, "-m", "loadtest.bench_prefill", "--arm", arm, "--prompts",
                                  str(prompts_file), "--max-tokens", str(args.max_tokens)]
                                 + (["--concurrency", str(args.concurrency)] if args.concurrency else []),
                                 capture_output=True, text=True, timeout=1800)
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                raise RuntimeError(f"arm {arm} failed:\n{out.stderr[-4000:]}")
            result = json.loads(lines[-1][len("RESULT "):])
            runs[arm].append(result)
            print(f"round {r + 1} {arm}: mean TTFT {st.mean(result['ttft_s']):.2f} s, p99 gap {p99(result['gap_s']):.2f} s, "
                  f"wall {result['wall_s']:.2f} s (block {result['block_size']})", file=sys.stderr, flush=True)

    def mean_ttft(x: dict) -> float:
        return st.mean(x["ttft_s"])

    def mean_gap(x: dict) -> float:
        return st.mean(x["gap_s"])

    ratios = {arm: [mean_ttft(x) / mean_ttft(v) for x, v in zip(runs[arm], runs["vllm"])]
              for arm in args.arms if arm != "vllm" and "vllm" in runs}

    def render(result: dict) -> str:
        lines = header(result, "Time to first token at long prompts, arm by arm",
                       f"dtype {result['machine']['cpu_dtype_auto']} (`auto`), compiled, one engine thread")
        arrival = (f"closed loop, {args.concurrency} in flight" if args.concurrency else "submitted at once")
        lines += [f"{args.requests} prompts of ~{args.tokens} tokens of natural text, {arrival}, {args.max_tokens} "
                 f"tokens each (greedy, ignore_eos); one fresh process per arm and round, arms alternated over "
                 f"{args.rounds} rounds. TTFT from each request's submission; gap: time between a request's "
                 "consecutive outputs (ITL); ratio: the arm's mean TTFT / the `vllm` arm's in the same round.", "",
                 "| arm | KV block | mean TTFT per round (s) | mean / p99 gap per round (s) | batch wall per round (s) "
                 "| engine start per round (s) | mean TTFT / vllm's |",
                 "|---|---|---|---|---|---|---|"]
        for arm, xs in result["runs"].items():
            r = result["ratios"].get(arm)
            cell = f"{st.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]" if r else "-"
            ttfts = ", ".join(f"{mean_ttft(x):.2f}" for x in xs)
            gaps = ", ".join(f"{mean_gap(x):.2f} / {p99(x['gap_s']):.2f}" if x.get("gap_s") else "-" for x in xs)
            walls = ", ".join(f"{x['wall_s']:.2f}" for x in xs)
            starts = ", ".join(f"{x['start_s']:.1f}" if "start_s" in x else "-" for x in xs)
            lines.append(f"| {arm} | {xs[0]['block_size']} | {ttfts} | {gaps} | {walls} | {starts} | {cell} |")
        return "\n".join(lines + [""])

    publish("loadtest.bench_prefill", argv, args.out,
            {"settings": {k: v for k, v in vars(args).items() if k not in ("arm", "prompts")},
             "runs": runs, "ratios": ratios}, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
