"""A decode step's linear layers on bfloat16 weights (kernels/csrc/linear_bf16w.c) against vLLM's float32 GEMM, in
one process.

    make bench-cpu-linear ARGS="--rows 1 4 8 12 16 24 32 48 64 96 128 --threads 1 2 --rounds 3"

Where a float32 engine serves a bfloat16 checkpoint, ``engine.bf16_decode_weights`` runs the steps of at most N rows
on our kernel and the others on the GEMM vLLM gives float32 weights on CPU (oneDNN over its packed float32 copy,
``vllm._custom_ops.create_onednn_mm``). This times both on every linear layer of a model (``--model``; by default
the default model: its layers' qkv, o, gate_up and down projections and the LM head, shapes from its config) at
``--rows`` rows and ``--threads`` engine threads, the arms alternating within each round: vLLM's GEMM, and our kernel
as built for each instruction set the CPU runs (AVX2, and AVX-512 where it has it; the engine uses the widest).
The weights are random bfloat16 values (the time does not depend on them) and together exceed the last-level cache,
so each layer reads from memory, as in an engine step. Reported per step (all layers), medians over rounds, with
each round's ratio; the rows up to which each build outran the GEMM are what ``auto`` takes
(``kernels.cpu_linear.rows``).
"""
from __future__ import annotations

import argparse
import json
import statistics as st
import sys
import tempfile
import time
from pathlib import Path

import torch

from loadtest.machine import header, publish


def layer_shapes(model_dir: Path, layers: int | None) -> list[tuple[int, int]]:
    """(N, K) of each linear layer a decode step multiplies by, in order: per decoder layer the fused qkv, o,
    fused gate_up and down projections (as vLLM's Llama-family models hold them), then the LM head."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", hidden // heads)
    per_layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
                 (hidden, inter)]
    count = config["num_hidden_layers"] if layers is None else layers
    return per_layer * count + [(config["vocab_size"], hidden)]


def measure(args, shapes: list[tuple[int, int]]) -> tuple[list[dict], list[str]]:
    """Each thread count in a process of its own, as an engine runs at one: vLLM's oneDNN GEMM keeps the primitives
    it made at the first thread count a process ran (a later, larger count ran no faster, measured)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    results: list[dict] = []
    builds: list[str] = []
    for threads in args.threads:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows, builds = pool.submit(_measure, args, shapes, threads).result()
        results += rows
    return results, builds


def _measure(args, shapes: list[tuple[int, int]], threads: int) -> tuple[list[dict], list[str]]:
    from vllm import _custom_ops as ops

    from kernels import cbuild, cpu_linear

    torch.set_num_threads(threads)  # before anything made in this process can fix a count of its own
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for n, k in shapes]
    with tempfile.TemporaryDirectory() as tmp:
        builds = {name: cpu_linear.load(str(cbuild.build_for("linear_bf16w", isa, Path(tmp))))
                  for name, isa in cbuild.runnable_isas("linear_bf16w").items() if name != "scalar"}
    panels = {name: [cpu_linear.pack(w, lib) for w in weights] for name, lib in builds.items()}
    arms = ["vllm", *builds]
    results = []
    handlers = [ops.create_onednn_mm(w.float().t(), 32) for w in weights]
    for rows in args.rows:
        xs = [torch.randn(rows, k, generator=gen) for _, k in shapes]
        outs = {arm: [torch.empty(rows, n) for n, _ in shapes] for arm in arms}

        def step(arm: str, xs: list = xs, outs: dict = outs, handlers: list = handlers) -> float:
            started = time.perf_counter()
            for i, (n, _) in enumerate(shapes):
                if arm == "vllm":
                    torch.ops._C.onednn_mm(outs[arm][i], xs[i], None, handlers[i].handler_tensor)
                elif not cpu_linear.linear_bf16w(xs[i], panels[arm][i], n, None, outs[arm][i], builds[arm]):
                    raise RuntimeError(f"the {arm} build declined a layer of {n} x {xs[i].shape[1]}")
            return time.perf_counter() - started

        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                step(arm)  # warm-up, untimed
                times[arm].append(st.median(step(arm) for _ in range(args.steps)))
        for arm in builds:  # the same products, or the comparison means nothing (float32 sums in either order)
            for ours, theirs in zip(outs[arm], outs["vllm"], strict=True):
                if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-3):
                    raise RuntimeError(f"the {arm} build and vLLM's GEMM disagree")
        row = {"rows": rows, "threads": threads, **{f"{arm}_s": times[arm] for arm in arms},
               "ratios": {arm: [o / v for o, v in zip(times[arm], times["vllm"], strict=True)] for arm in builds}}
        results.append(row)
        print(f"{rows} rows, {threads} thread(s): vLLM's GEMM {1e3 * st.median(times['vllm']):.1f} ms, "
              + ", ".join(f"{arm} {1e3 * st.median(times[arm]):.1f} ms" for arm in builds),
              file=sys.stderr, flush=True)
    return results, list(builds)


def _render(result: dict) -> str:
    builds = result["builds"]
    lines = header(result, "A decode step's linear layers on bfloat16 weights against vLLM's float32 GEMM",
                   f"{result['layers']} linear layers of {result['model']} ({result['weight_mb']:.0f} MB of "
                   "bfloat16 weights)")
    lines += [f"Per step (all layers), ms, median of {result['rounds']} rounds, each the median of "
              f"{result['steps']} steps; the arms alternate within each round. Ratio: our kernel's time / vLLM's "
              "(below 1 ours is faster), median [range over rounds]. `auto` in this build: up to "
              f"{result['auto_rows']} rows.", "",
              "| rows | threads | vLLM's oneDNN float32 | " + " | ".join(f"ours, {b} build (ratio)" for b in builds)
              + " |", "|---|---|---|" + "---|" * len(builds)]
    for r in sorted(result["rows"], key=lambda r: (r["rows"], r["threads"])):
        cells = [f"{1e3 * st.median(r[f'{b}_s']):.1f} ({st.median(r['ratios'][b]):.2f}x "
                 f"[{min(r['ratios'][b]):.2f}-{max(r['ratios'][b]):.2f}])" for b in builds]
        lines.append(f"| {r['rows']} | {r['threads']} | {1e3 * st.median(r['vllm_s']):.1f} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="a local HF model directory, or the default model")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per arm and round")
    parser.add_argument("--out", default="docs/results/cpu-linear")
    args = parser.parse_args(argv)
    from kernels import cpu_linear
    from workers.model_store import resolve_model

    if not cpu_linear.available():
        parser.error("our kernel needs AVX2 and FMA and a C compiler")
    model_dir = resolve_model(args.model)
    shapes = layer_shapes(model_dir, args.layers)
    rows, builds = measure(args, shapes)
    publish("loadtest.bench_cpu_linear", argv, args.out,
            {"model": model_dir.name, "layers": len(shapes), "weight_mb": 2 * sum(n * k for n, k in shapes) / 1e6,
             "builds": builds, "auto_rows": cpu_linear.rows(), "rows": rows, "rounds": args.rounds,
             "steps": args.steps}, _render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
