"""GPU check of the Triton kernels: correctness against their torch references, then speed.

Runs with torch, triton and this repository only (the GPU machines lent to us have no vLLM), in one
call: ``make gpu-check`` (``python -m loadtest.gpu_check``). Results go to ``$OUT/gpu-kernels.{json,md}``
when ``OUT`` is set, else to ``docs/results/gpu-kernels.{json,md}``.

What it checks, on CUDA at realistic shapes:
1. correctness: the entropy estimators (exact, top-k, tail) against ``kernels.entropy``; key
   summaries, block scores and top-K selection (``kernels.block_select_triton.compact_table``, the
   calls the GPU attention backend makes per layer) against ``kernels.block_select``; the pruned
   paged-decode kernels (ours and vLLM's ``unified_attention`` on the compacted table) against
   ``kernels.pruned_decode_triton.reference_decode``;
2. speed: one layer's decode attention for a Llama-3-8B-like shape (32 query heads, 8 KV heads,
   head dim 128, bf16 cache), dense (vLLM's kernel over every block; PyTorch's SDPA over KV already
   gathered into one contiguous tensor; our kernel over every block) against pruned (selection plus
   the kernel over the kept blocks) at kept fractions 1/4, 1/8, 1/16; the exact entropy kernel's
   bytes of logits read per second against the memory bandwidth.

vLLM's kernel: where vLLM is importable it is used as installed; elsewhere ``--vllm-ops DIR`` loads
vLLM's own two source files (``triton_unified_attention.py``, ``triton_attention_helpers.py``, copied
unmodified by ``make gpu-check-vendor``) with the handful of names they import from the rest of vLLM
supplied here (``_VllmShims``): the logger, one environment flag, the platform's fp8 dtype and
capability test, and the KV quantization enum. Without either, the vLLM rows are left out and say so.

Timing: each timed call is preceded by a write of a buffer larger than the GPU's L2 cache (so the
KV cache and the logits come from memory, as they do between layers when serving) and measured
with CUDA events around that call alone; the flush is long enough that the host has queued the
whole call before the GPU reaches it, so the events measure GPU time, not Python launch time. The
launch time is reported separately ("host"), because the pruned backend runs attention outside CUDA
graphs. ``--tiny`` runs everything at toy shapes on the CPU under ``TRITON_INTERPRET=1`` (the test
suite does, so the script cannot rot); its timings mean nothing.
"""
from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback
import types
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
KEEP_FRACTIONS = (4, 8, 16)  # 1/4, 1/8, 1/16 of the blocks
SECTIONS = ("entropy", "selection", "decode", "entropy-speed", "entropy-sweep", "attention-speed")


# ----------------------------------------------------------------------------- shapes

def shapes(tiny: bool) -> dict:
    if tiny:
        return {"vocabs": (1000, 3001), "batches": (1, 3), "dtypes": (torch.float32,),
                "heads": 4, "kv_heads": 2, "head_dim": 16, "block_sizes": (16,), "contexts": (320,),
                "attn_batches": (2,), "reference_batches": {320: (1, 2)}, "iters": 1,
                "entropy_speed": ((2, 3001),), "sweep_blocks": (256,), "breakdown_context": 320,
                "cache_dtype": torch.float32}
    return {"vocabs": (32000, 128256, 151936), "batches": (1, 8, 64), "dtypes": (torch.bfloat16, torch.float32),
            "heads": 32, "kv_heads": 8, "head_dim": 128, "block_sizes": (16, 32, 64),
            "contexts": (8192, 32768, 131072), "attn_batches": (1, 8, 32),
            "reference_batches": {8192: (1, 8, 32), 32768: (1, 8), 131072: (1, 4)}, "iters": 20,
            "entropy_speed": ((1, 128256), (8, 128256), (64, 32000), (64, 128256), (64, 151936)),
            "sweep_blocks": (1024, 2048, 4096), "breakdown_context": 32768, "cache_dtype": torch.bfloat16}


# ----------------------------------------------------------------------------- vLLM's kernel

class _VllmShims:
    """The names vLLM's two attention source files import from the rest of vLLM, for a machine without it."""

    class KVQuantMode(enum.IntEnum):  # vllm/v1/kv_cache_interface.py, values as in vLLM 0.32.0
        NONE = 0
        FP8_PER_TENSOR = 1
        INT8_PER_TOKEN_HEAD = 2
        FP8_PER_TOKEN_HEAD = 3
        INT4_PER_TOKEN_HEAD = 4

    class Platform:
        def fp8_dtype(self):
            return torch.float8_e4m3fn

        def is_device_capability_family(self, family: int) -> bool:
            if not torch.cuda.is_available():
                return False
            return torch.cuda.get_device_capability()[0] == family // 10  # 100: capability 10.x

    @classmethod
    def install(cls) -> None:
        import triton
        import triton.language as tl

        def module(name: str, **attrs) -> None:
            mod = types.ModuleType(name)
            mod.__dict__.update(attrs)
            sys.modules[name] = mod

        for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
            module(name, __path__=[])
        module("vllm.envs", VLLM_BATCH_INVARIANT=False)
        module("vllm.logger", init_logger=logging.getLogger)
        module("vllm.platforms", current_platform=cls.Platform())
        module("vllm.triton_utils", triton=triton, tl=tl)
        module("vllm.v1.kv_cache_interface", KVQuantMode=cls.KVQuantMode)


def load_vllm_attention(ops_dir: str | None):
    """(unified_attention, where it came from), or (None, why not)."""
    if ops_dir:
        _VllmShims.install()
        for name in ("triton_attention_helpers", "triton_unified_attention"):
            path = Path(ops_dir) / f"{name}.py"
            if not path.exists():
                return None, f"{path} missing (make gpu-check-vendor copies it from the installed vLLM)"
            spec = importlib.util.spec_from_file_location(f"vllm.v1.attention.ops.{name}", path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        version = (Path(ops_dir) / "VERSION").read_text().strip() if (Path(ops_dir) / "VERSION").exists() else "?"
        return mod.unified_attention, f"vLLM {version} source files from {ops_dir} (names from the rest of vLLM shimmed)"
    try:
        import vllm
        import vllm.triton_utils as vtu
    except ImportError:
        return None, "vLLM not installed and no --vllm-ops given"
    if not vtu.HAS_TRITON:
        # vLLM swaps Triton for placeholders where it sees no GPU backend (the interpreter run here)
        import triton
        import triton.language as tl
        vtu.triton, vtu.tl = triton, tl
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    return unified_attention, f"vLLM {vllm.__version__} as installed"


class VllmDecode:
    """vLLM's TRITON_ATTN decode call as its metadata builder sets it up (vllm/v1/attention/backends/triton_attn.py):
    the 3D (segmented softmax) kernel for up to 128 // KV heads sequences, 16 segments."""

    def __init__(self, fn, heads: int, kv_heads: int, head_dim: int, device):
        import triton
        self.fn = fn
        self.threshold = 128 // kv_heads
        self.segments = 16
        padded = triton.next_power_of_2(head_dim)
        self.segm_out = torch.empty(self.threshold, heads, self.segments, padded, dtype=torch.float32, device=device)
        self.segm_max = torch.empty(self.threshold, heads, self.segments, dtype=torch.float32, device=device)
        self.segm_sum = torch.empty_like(self.segm_max)

    def __call__(self, q, key_cache, value_cache, table, lens, max_len: int, scale: float, out):
        seqs = q.shape[0]
        cu = torch.arange(seqs + 1, dtype=torch.int32, device=q.device)
        self.fn(q=q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=lens,
                max_seqlen_k=max_len, softmax_scale=scale, causal=True, window_size=(-1, -1), block_table=table,
                softcap=0, q_descale=None, k_descale=None, v_descale=None, seq_threshold_3D=self.threshold,
                num_par_softmax_segments=self.segments, softmax_segm_output=self.segm_out,
                softmax_segm_max=self.segm_max, softmax_segm_expsum=self.segm_sum)
        return out


# ----------------------------------------------------------------------------- timing

class Timer:
    def __init__(self, device: torch.device, iters: int):
        self.device, self.iters = device, iters
        self.cuda = device.type == "cuda"
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
            # >= 2 GiB (~0.7 ms on an H100): longer than the host needs to queue a timed call
            self.flush = torch.empty(max(32 * l2, 2 << 30) // 4, dtype=torch.float32, device=device)

    def gpu_ms(self, fn) -> list[float]:
        """GPU time of each call (cache flushed before each), ms."""
        if not self.cuda:  # the interpreter: nothing to compile or warm, and the times mean nothing
            times = []
            for _ in range(self.iters):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return times
        fn()  # compile and warm before timing
        pairs = []
        for _ in range(self.iters):
            self.flush.fill_(1.0)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in pairs]

    def host_ms(self, fn) -> float:
        """Wall time per call of back-to-back calls, synchronised at the end: launch cost included, ms."""
        if self.cuda:
            fn()
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(self.iters):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3 / self.iters


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> list[float]:
    qs = sorted(xs)
    return [qs[len(qs) // 10], qs[-1 - len(qs) // 10]]


# ----------------------------------------------------------------------------- correctness

def entropy_logits(rows: int, vocab: int, dtype, device, seed: int) -> torch.Tensor:
    """Rows from nearly one-hot to nearly flat; every other row masks a tenth of the vocabulary."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = torch.logspace(-1, 1.2, rows, device=device)[:, None]
    z = torch.randn(rows, vocab, device=device, generator=gen) * scale
    z[1::2, ::10] = float("-inf")
    return z.to(dtype)


def check_entropy(sh: dict, device, results: list) -> None:
    from kernels import entropy, entropy_triton

    for vocab in sh["vocabs"]:
        for rows in sh["batches"]:
            for dtype in sh["dtypes"]:
                z = entropy_logits(rows, vocab, dtype, device, seed=vocab + rows)
                want_exact = entropy.exact_entropy(z.double()).float()
                got = {"exact": entropy_triton.exact_entropy(z)}
                got["topk"], got["tail"] = entropy_triton.topk_entropies(z, 64)
                want_trunc, want_corr = entropy.topk_entropies(z.double(), 64)
                want = {"exact": want_exact, "topk": want_trunc.float(), "tail": want_corr.float()}
                for name in got:
                    err = float((got[name] - want[name]).abs().max())
                    results.append({"check": f"entropy {name}", "shape": f"{rows} x {vocab} {str(dtype)[6:]}",
                                    "max_abs_err": err, "tol": 2e-3, "ok": err <= 2e-3})


def paged_cache(blocks: int, sh: dict, block_size: int, device, seed: int):
    """Views of the Triton backend's cache [blocks, KV heads, block_size, 2 * head_dim] (keys | values per
    token): the keys as compacted_table reads them, and the key and value caches as the attention kernels do."""
    gen = torch.Generator(device=device).manual_seed(seed)
    d = sh["head_dim"]
    kv = torch.randn(blocks, sh["kv_heads"], block_size, 2 * d, device=device, generator=gen, dtype=sh["cache_dtype"])
    key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)  # [blocks, T, KVH, D], as TritonAttentionImpl
    return kv[..., :d], key_cache, value_cache


class Step:
    """One decode step's pruning inputs for ``seqs`` sequences of ``context`` tokens (what PrunePlan carries)."""

    def __init__(self, sh: dict, block_size: int, context: int, seqs: int, keep_div: int, device, seed: int):
        from kernels.block_select import selection_bias

        gen = torch.Generator(device=device).manual_seed(seed)
        self.block_size, self.context = block_size, context
        per_seq = -(-context // block_size)
        self.blocks = seqs * per_seq + 1
        self.keys, self.key_cache, self.value_cache = paged_cache(self.blocks, sh, block_size, device, seed)
        # sequences own shuffled physical blocks, as a paged cache hands them out
        self.physical = torch.randperm(self.blocks - 1, device=device, generator=gen)[: seqs * per_seq]
        self.physical = self.physical.view(seqs, per_seq).contiguous()
        self.num_blocks = torch.full((seqs,), per_seq, device=device)
        self.lens = torch.full((seqs,), context, dtype=torch.int32, device=device)
        info = torch.randn(seqs, per_seq, device=device, generator=gen).cpu()
        self.bias = selection_bias(self.num_blocks.cpu(), per_seq, info).to(device)
        self.q = torch.randn(seqs, sh["heads"], sh["head_dim"], device=device, generator=gen).to(sh["cache_dtype"])
        self.scale = sh["head_dim"] ** -0.5
        self.summaries = torch.zeros(sh["kv_heads"], self.blocks, 2 * sh["head_dim"], device=device,
                                     dtype=sh["cache_dtype"])  # as workers.pruned_attention_gpu keeps them
        # a decode step summarizes the blocks that filled up since the last one: at most one per sequence
        self.summarize = self.physical[:, -2].contiguous()
        self.with_keep(keep_div)

    def with_keep(self, keep_div: int) -> Step:
        """Keep 1/keep_div of each sequence's blocks (at least the sink and the current one)."""
        seqs, per_seq = self.physical.shape
        device = self.physical.device
        self.keep_n = max(2, per_seq // keep_div)
        self.keep = torch.full((seqs,), self.keep_n, device=device)
        self.beyond = torch.zeros(seqs, self.keep_n, dtype=torch.bool, device=device)
        self.table = self.physical.to(torch.int32).contiguous()
        self.rows = torch.arange(seqs, device=device)
        tail = self.context - (per_seq - 1) * self.block_size
        self.pruned_lens = torch.full((seqs,), (self.keep_n - 1) * self.block_size + tail, dtype=torch.int32,
                                      device=device)
        return self

    def summarize_all(self) -> None:
        from kernels.block_select_triton import summarize_blocks
        summarize_blocks(self.keys, self.physical.flatten(), self.summaries)

    def choose(self) -> torch.Tensor:
        """One layer's selection as the backend runs it; the compacted table for the kernel."""
        from kernels.block_select_triton import compact_table
        compact_table(self.q, self.keys, self.summaries, self.scale, self.summarize, self.physical, self.num_blocks,
                      self.bias, self.keep, self.table, self.rows, self.keep_n, self.beyond)
        return self.table

    def parts(self) -> dict:
        """The selection's steps one by one (what compact_table runs), for a breakdown."""
        from kernels import block_select_triton as bt
        scores = bt.block_scores(self.q, self.physical, self.num_blocks, self.summaries, self.scale, self.bias)
        return {
            "summarize": partial(bt.summarize_blocks, self.keys, self.summarize, self.summaries),
            "scores": partial(bt.block_scores, self.q, self.physical, self.num_blocks, self.summaries, self.scale,
                              self.bias),
            "top-K into the table": partial(bt.select_into_table, scores, self.keep, self.physical, self.table,
                                            self.rows, self.keep_n, self.beyond),
            "torch.topk + sort (before)": partial(bt.select_blocks, scores, self.keep, self.keep_n, self.beyond),
        }


def check_selection(sh: dict, device, results: list) -> None:
    from kernels import block_select

    d, g = sh["head_dim"], sh["heads"] // sh["kv_heads"]
    for bs in sh["block_sizes"]:
        for context in sh["contexts"]:
            seqs = max(sh["reference_batches"][context])
            step = Step(sh, bs, context, seqs, 8, device, seed=bs + context)
            step.summarize_all()
            ref = torch.zeros(step.summaries.shape, device=device)  # the torch path keeps float32 summaries
            block_select.summarize_blocks(step.keys, step.physical.flatten(), ref)
            err = float((ref - step.summaries.float()).abs().max())
            shape = f"block {bs}, {context} tokens x {seqs}"
            results.append({"check": "key summaries (max | min)", "shape": shape, "max_abs_err": err, "tol": 0.0,
                            "ok": err == 0.0})
            from kernels.block_select_triton import block_scores
            got = block_scores(step.q, step.physical, step.num_blocks, step.summaries, step.scale, step.bias)
            want = block_select.block_scores(step.q.view(seqs, sh["kv_heads"], g, d), ref, step.physical,
                                             step.scale, step.bias)
            finite = torch.isfinite(want)
            err = float((got[finite] - want[finite]).abs().max() / want[finite].abs().max().clamp(min=1))
            same_inf = bool(torch.equal(torch.isfinite(got), finite))
            results.append({"check": "block scores (relative)", "shape": shape, "max_abs_err": err, "tol": 1e-4,
                            "ok": err <= 1e-4 and same_inf})
            chosen = step.choose()[:, : step.keep_n].sort(dim=1).values
            expect = step.physical.gather(1, block_select.select_blocks(want, step.keep, step.keep_n, step.beyond))
            expect = expect.sort(dim=1).values
            # a near-tie at the K-th score may go either way: count a mismatch only if its scores differ
            mismatch = (chosen.long() != expect.long()).any(dim=1)
            kth = want.topk(step.keep_n, dim=1).values[:, -1:]
            close = ((want - kth).abs() <= 1e-4 * kth.abs().clamp(min=1)).sum(dim=1) > 1
            bad = int((mismatch & ~close).sum())
            results.append({"check": "top-K kept blocks (rows that differ)", "shape": shape, "max_abs_err": bad,
                            "tol": 0, "ok": bad == 0})


def check_decode(sh: dict, device, vllm_decode, results: list) -> None:
    from kernels.pruned_decode_triton import pruned_decode, reference_decode

    for bs in sh["block_sizes"]:
        for context in sh["contexts"]:
            for seqs in sh["reference_batches"][context]:
                step = Step(sh, bs, context, seqs, 8, device, seed=3 * bs + context + seqs)
                step.summarize_all()
                table = step.choose()
                shape = f"block {bs}, {context} tokens x {seqs}, 1/8 kept"
                want = reference_decode(step.q, step.key_cache, step.value_cache, table, step.pruned_lens, step.scale)
                kernels = {"ours": partial(pruned_decode, step.q, step.key_cache, step.value_cache, table,
                                           step.pruned_lens, step.scale)}
                if vllm_decode is not None:
                    kernels["vLLM unified_attention"] = partial(
                        vllm_decode, step.q, step.key_cache, step.value_cache, table, step.pruned_lens,
                        int(step.pruned_lens.max()), step.scale, torch.empty_like(step.q))
                for name, fn in kernels.items():
                    err = float((fn().float() - want.float()).abs().max())
                    tol = 2e-2 if sh["cache_dtype"] == torch.bfloat16 else 1e-4
                    results.append({"check": f"pruned decode, {name}", "shape": shape, "max_abs_err": err,
                                    "tol": tol, "ok": err <= tol})


def attention_shapes(sh: dict) -> list[tuple[int, int, int]]:
    """(block, context, batch), the goal's 32K shapes first so a run cut short by its budget still has them."""
    all_shapes = [(bs, c, b) for bs in sh["block_sizes"] for c in sh["contexts"] for b in sh["attn_batches"]]
    return sorted(all_shapes, key=lambda x: (x[1] != 32768, x))


def bench_attention(sh: dict, device, vllm_decode, timer: Timer, rows: list, deadline: float, save) -> None:
    for bs, context, seqs in attention_shapes(sh):
        if time.time() > deadline:
            row = {"block": bs, "context": context, "batch": seqs, "skipped": "time budget spent"}
        else:
            try:
                row = bench_shape(sh, device, vllm_decode, timer, bs, context, seqs)
            except Exception as exc:  # one shape failing (memory, a kernel) must not cost the rest of the run
                row = {"block": bs, "context": context, "batch": seqs, "error": repr(exc)[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bench_shape(sh: dict, device, vllm_decode, timer: Timer, bs: int, context: int, seqs: int) -> dict:
    import torch.nn.functional as F

    from kernels.pruned_decode_triton import pruned_decode

    step = Step(sh, bs, context, seqs, 8, device, seed=bs + context + seqs)
    step.summarize_all()
    full_table = step.physical.to(torch.int32).contiguous()
    out = torch.empty_like(step.q)
    row: dict = {"block": bs, "context": context, "batch": seqs}
    dense: dict[str, Any] = {
        "ours": partial(pruned_decode, step.q, step.key_cache, step.value_cache, full_table, step.lens, step.scale)}
    if vllm_decode is not None:
        dense["vllm"] = partial(vllm_decode, step.q, step.key_cache, step.value_cache, full_table, step.lens, context,
                                step.scale, out)
    # SDPA over KV already gathered into [batch, KVH, T, D]: dense attention without paging
    k = step.key_cache[step.physical].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = step.value_cache[step.physical].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    dense["sdpa"] = partial(F.scaled_dot_product_attention, step.q[:, :, None, :], k, v, scale=step.scale,
                            enable_gqa=True)
    for name, fn in dense.items():
        timed(row, f"dense_{name}", partial(timer.gpu_ms, fn))
    if "vllm" in dense:
        timed(row, "dense_vllm_host", partial(timer.host_ms, dense["vllm"]))
    dense.clear()  # the contiguous copies go before the pruned runs
    del k, v
    for div in KEEP_FRACTIONS:
        step.with_keep(div)
        table = step.choose()
        kernels: dict[str, Any] = {"select": step.choose,
                   "ours": partial(pruned_decode, step.q, step.key_cache, step.value_cache, table, step.pruned_lens,
                                   step.scale)}
        if vllm_decode is not None:
            kernels["vllm"] = partial(vllm_decode, step.q, step.key_cache, step.value_cache, table, step.pruned_lens,
                                      int(step.pruned_lens.max()), step.scale, out)
            kernels["select+vllm"] = partial(_both, step.choose, kernels["vllm"])
        kernels["select+ours"] = partial(_both, step.choose, kernels["ours"])
        for name, fn in kernels.items():
            timed(row, f"keep1/{div}_{name}", partial(timer.gpu_ms, fn))
        row[f"keep1/{div}_kept_blocks"] = step.keep_n
        if div == 8 and context == sh["breakdown_context"]:
            for name, fn in step.parts().items():
                timed(row, f"keep1/8_part {name}", partial(timer.gpu_ms, fn))
        if vllm_decode is not None:
            timed(row, f"keep1/{div}_select+vllm_host", partial(timer.host_ms, kernels["select+vllm"]))
    return row


def _both(first, second) -> None:
    first()
    second()


def timed(row: dict, key: str, measure) -> None:
    """row[key_ms] (median) and row[key_spread] (10th-90th percentile), or row[key_error]."""
    try:
        times = measure()
    except Exception as exc:
        row[f"{key}_error"] = repr(exc)[:300]
        return
    if isinstance(times, float):
        row[f"{key}_ms"] = times
    else:
        row[f"{key}_ms"], row[f"{key}_spread"] = median(times), spread(times)


def nominal_bandwidth(device) -> float | None:
    """Bytes/s from the memory clock and bus width the driver reports (double data rate), if torch exposes them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def bench_entropy(sh: dict, device, timer: Timer, rows: list) -> dict:
    from kernels import entropy, entropy_triton

    bandwidth = {}
    if device.type == "cuda":
        src = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
        dst = torch.empty_like(src)
        times = timer.gpu_ms(lambda: dst.copy_(src))
        bandwidth["copy_bytes_per_s"] = 2 * src.numel() * 4 / (median(times) / 1e3)
        bandwidth["nominal_bytes_per_s"] = nominal_bandwidth(device)
        del src, dst
    for rows_n, vocab in sh["entropy_speed"]:
        for dtype in sh["dtypes"]:
            z = entropy_logits(rows_n, vocab, dtype, device, seed=1)
            nbytes = z.numel() * z.element_size()
            row = {"batch": rows_n, "vocab": vocab, "dtype": str(dtype)[6:], "bytes": nbytes}
            for name, fn in {"exact_triton": partial(entropy_triton.exact_entropy, z),
                             "exact_torch": partial(entropy.exact_entropy, z),
                             "topk64_triton": partial(entropy_triton.topk_entropies, z, 64),
                             # a read-only reduction over the same bytes: what one torch kernel reaches at this size
                             "amax_torch": partial(torch.amax, z, dim=-1)}.items():
                times = timer.gpu_ms(fn)
                row[f"{name}_us"] = median(times) * 1e3
                row[f"{name}_bytes_per_s"] = nbytes / (median(times) / 1e3)
            row["exact_triton_host_us"] = timer.host_ms(partial(entropy_triton.exact_entropy, z)) * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
    return bandwidth


def sweep_entropy(sh: dict, device, timer: Timer, rows: list) -> None:
    """Launch shapes of the exact kernel at the goal's shape (64 rows): columns per iteration, warps, and
    programs per multiprocessor (10**6: one block of columns per program)."""
    from kernels import entropy_triton

    batch, vocab = sh["entropy_speed"][-2] if len(sh["entropy_speed"]) > 1 else sh["entropy_speed"][0]
    for dtype in sh["dtypes"]:
        z = entropy_logits(batch, vocab, dtype, device, seed=1)
        nbytes = z.numel() * z.element_size()
        for block in sh["sweep_blocks"]:
            for warps in (4, 8):
                for per_unit in (2, 8, 32, 10**6):
                    fn = partial(entropy_triton.exact_entropy, z, block=block, num_warps=warps, per_unit=per_unit)
                    us = median(timer.gpu_ms(fn)) * 1e3
                    rows.append({"batch": batch, "vocab": vocab, "dtype": str(dtype)[6:], "block": block,
                                 "num_warps": warps, "per_unit": per_unit, "us": us,
                                 "bytes_per_s": nbytes / (us / 1e6)})


# ----------------------------------------------------------------------------- report

def describe(device, vllm_source: str) -> dict:
    import triton
    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "vllm_kernel": vllm_source, "interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({"gpu": props.name, "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
                     "multiprocessors": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1),
                     "l2_mib": getattr(props, "L2_cache_size", 0) / 2**20, "cuda": torch.version.cuda})
    else:
        info["gpu"] = "none (CPU tensors under TRITON_INTERPRET=1: timings are meaningless)"
    return info


def goals(attention: list[dict], bandwidth: dict, ent: list[dict]) -> list[str]:
    lines = []
    for row in attention:
        if row["context"] != 32768 or "keep1/8_select+vllm_ms" not in row or "dense_vllm_ms" not in row:
            continue
        total = row["keep1/8_select+vllm_ms"]
        ratio = row["dense_vllm_ms"] / total
        share = row["keep1/8_select_ms"] / total
        lines.append(f"32K tokens, block {row['block']}, batch {row['batch']}, 1/8 kept: pruned (selection included) "
                     f"{ratio:.2f}x vLLM's dense kernel (goal >= 4x: {'met' if ratio >= 4 else 'not met'}), "
                     f"{row.get('dense_sdpa_ms', float('nan')) / total:.2f}x SDPA on contiguous KV; "
                     f"selection {share:.0%} of the pruned step (goal <= 15%: {'met' if share <= 0.15 else 'not met'})")
    peak = bandwidth.get("nominal_bytes_per_s") or bandwidth.get("copy_bytes_per_s")
    for row in ent:
        if row["batch"] == 64 and row["vocab"] == 128256 and peak:
            frac = row["exact_triton_bytes_per_s"] / peak
            lines.append(f"exact entropy, 64 x 128256 {row['dtype']}: {row['exact_triton_bytes_per_s'] / 1e9:.0f} GB/s, "
                         f"{frac:.0%} of {peak / 1e9:.0f} GB/s (goal >= 60%: {'met' if frac >= 0.6 else 'not met'})")
    return lines


def _ms(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if key in row else "-"


def render(result: dict) -> str:
    m = result["machine"]
    out = [f"# Triton kernels on a GPU: correctness and speed ({result['date']})", "",
           f"Command: `{result['command']}`", "",
           "Machine: " + ", ".join(f"{k} {v}" for k, v in m.items()), "",
           f"Wall time of the whole check: {result['seconds']:.0f} s.", "", "## Correctness", "",
           f"{sum(r['ok'] for r in result['correctness'])} of {len(result['correctness'])} checks pass.", "",
           "| check | shape | max error | tolerance | ok |", "|---|---|---|---|---|"]
    for r in result["correctness"]:
        verdict = "yes" if r["ok"] else "**NO**"
        out.append(f"| {r['check']} | {r['shape']} | {r['max_abs_err']:.3g} | {r['tol']:.3g} | {verdict} |")
    out += ["", "## Goals", ""] + [f"- {line}" for line in result["goals"]]
    out += ["", "## Decode attention, one layer (GPU ms per call, median; cache flushed before each call)", "",
            "Dense: vLLM's kernel over every block / SDPA over contiguous KV / our kernel over every block. "
            "Pruned: selection (summaries of the newly full blocks, scores, top-K, table) + vLLM's kernel over the "
            "kept blocks; the ratio is dense vLLM / pruned. Host: wall time per call of back-to-back calls, "
            "launches included.", "",
            "| block | context | batch | dense vLLM | dense SDPA | dense ours | keep | select | pruned vLLM | "
            "select + vLLM | ratio | select + ours | host: dense vLLM / select + vLLM |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["attention"]:
        if "error" in r or "skipped" in r:
            out.append(f"| {r['block']} | {r['context']} | {r['batch']} | {r.get('error') or r.get('skipped')} |")
            continue
        for div in KEEP_FRACTIONS:
            p = f"keep1/{div}_"
            ms = partial(_ms, r)
            both = "dense_vllm_ms" in r and p + "select+vllm_ms" in r
            ratio = f"{r['dense_vllm_ms'] / r[p + 'select+vllm_ms']:.2f}x" if both else "-"
            out.append(f"| {r['block']} | {r['context']} | {r['batch']} | {ms('dense_vllm_ms')} | {ms('dense_sdpa_ms')} | "
                       f"{ms('dense_ours_ms')} | 1/{div} ({r.get(p + 'kept_blocks')}) | {ms(p + 'select_ms')} | "
                       f"{ms(p + 'vllm_ms')} | {ms(p + 'select+vllm_ms')} | {ratio} | "
                       f"{ms(p + 'select+ours_ms')} | {ms('dense_vllm_host_ms')} / {ms(p + 'select+vllm_host_ms')} |")
    parts = [r for r in result["attention"] if "keep1/8_part scores_ms" in r]
    if parts:
        names = ("summarize", "scores", "top-K into the table", "torch.topk + sort (before)")
        out += ["", "### Where the selection's time goes (1/8 kept, the goal's context; GPU ms per step alone)", "",
                "| block | batch | " + " | ".join(names) + " | selection as one call |", "|---" * (len(names) + 3) + "|"]
        for r in parts:
            out.append(f"| {r['block']} | {r['batch']} | " + " | ".join(_ms(r, f"keep1/8_part {n}_ms") for n in names)
                       + f" | {_ms(r, 'keep1/8_select_ms')} |")
    bw = result["bandwidth"]
    out += ["", "## Entropy estimators (GPU time per call, median; logits flushed from L2 before each call)", "",
            "Bandwidth: " + ", ".join(f"{k.replace('_bytes_per_s', '')} {v / 1e9:.0f} GB/s" if isinstance(v, float)
                                      else f"{k} {v}" for k, v in bw.items() if v),
            "", "| batch | vocab | dtype | exact (Triton) µs | GB/s | exact (torch) µs | top-64 + tail (Triton) µs | "
            "host µs per exact call | torch.amax µs (GB/s): one read of the same bytes |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in result["entropy"]:
        out.append(f"| {r['batch']} | {r['vocab']} | {r['dtype']} | {r['exact_triton_us']:.1f} | "
                   f"{r['exact_triton_bytes_per_s'] / 1e9:.0f} | {r['exact_torch_us']:.1f} | {r['topk64_triton_us']:.1f} | "
                   f"{r['exact_triton_host_us']:.1f} | {r['amax_torch_us']:.1f} ({r['amax_torch_bytes_per_s'] / 1e9:.0f}) |")
    if result.get("entropy_sweep"):
        out += ["", "### Exact entropy kernel: launch shapes (GPU µs per call, median)", "",
                "| batch | vocab | dtype | columns per iteration | warps | programs per multiprocessor | µs | GB/s |",
                "|---|---|---|---|---|---|---|---|"]
        for r in result["entropy_sweep"]:
            per_unit = "one block each" if r["per_unit"] >= 10**6 else r["per_unit"]
            out.append(f"| {r['batch']} | {r['vocab']} | {r['dtype']} | {r['block']} | {r['num_warps']} | {per_unit} | "
                       f"{r['us']:.1f} | {r['bytes_per_s'] / 1e9:.0f} |")
    for err in result.get("errors", []):
        out += ["", f"## Error in {err['section']}", "", "```", err["traceback"].rstrip(), "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy shapes on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--vllm-ops", help="folder with vLLM's triton_unified_attention.py and its helpers")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="attention shapes not started by then are listed as skipped (the 32K ones run first)")
    parser.add_argument("--out", help="result path without suffix (default: $OUT/gpu-kernels or docs/results/gpu-kernels)")
    args = parser.parse_args(argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--tiny runs under TRITON_INTERPRET=1 (set it before Python starts)")
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device (use --tiny under TRITON_INTERPRET=1 for the CPU run)")
    sh = shapes(args.tiny)
    started = time.time()
    try:
        fn, source = load_vllm_attention(args.vllm_ops)
    except Exception as exc:  # a Triton too old or too new for vLLM's source: the other rows still run
        fn, source = None, f"vLLM kernel failed to load: {exc!r}"
    vllm_decode = VllmDecode(fn, sh["heads"], sh["kv_heads"], sh["head_dim"], device) if fn else None
    print(f"vLLM kernel: {source}", flush=True)
    out = args.out or (str(Path(os.environ["OUT"]) / "gpu-kernels") if os.environ.get("OUT")
                       else str(ROOT / "docs" / "results" / "gpu-kernels"))
    command = "python -m loadtest.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {
        "command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": describe(device, source), "seconds": 0.0,
        "correctness": [], "attention": [], "entropy": [], "bandwidth": {}, "goals": []}

    def save() -> None:  # after every section, so a run cut off by its time limit still leaves what it measured
        result["seconds"] = time.time() - started
        result["goals"] = goals(result["attention"], result["bandwidth"], result["entropy"])
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".json").write_text(json.dumps(result, indent=2))
        path.with_suffix(".md").write_text(render(result))

    torch.manual_seed(0)

    def run(section: str, call) -> None:
        if section not in args.sections:
            return
        try:
            call()
        except Exception as exc:  # recorded with its traceback; the other sections still run
            result.setdefault("errors", []).append({"section": section, "traceback": traceback.format_exc()})
            result["correctness"].append({"check": f"{section} crashed", "shape": repr(exc)[:200],
                                          "max_abs_err": float("nan"), "tol": 0.0, "ok": False})
        save()

    run("entropy", partial(check_entropy, sh, device, result["correctness"]))
    run("selection", partial(check_selection, sh, device, result["correctness"]))
    run("decode", partial(check_decode, sh, device, vllm_decode, result["correctness"]))
    for r in result["correctness"]:
        print(json.dumps(r), flush=True)
    timer = Timer(device, sh["iters"])
    run("entropy-speed", lambda: result.update(bandwidth=bench_entropy(sh, device, timer, result["entropy"])))
    run("entropy-sweep", partial(sweep_entropy, sh, device, timer, result.setdefault("entropy_sweep", [])))
    run("attention-speed", partial(bench_attention, sh, device, vllm_decode, timer, result["attention"],
                                   started + args.budget_s, save))
    save()
    print(render(result))
    return 0 if all(r["ok"] for r in result["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
