"""Start-up of our server against `vllm serve`: time to healthy and to a first answer, cold and warm caches.

    make bench-startup ARGS="--rounds 2 --vllm-args '--gpu-memory-utilization 0.5'"
        (writes docs/results/startup.{md,json})

Each start runs one server alone (``loadtest.bench_serve``'s pairs and launch code: ``defaults`` is
``make serve`` as shipped against ``vllm serve MODEL``) and records, from the moment its process starts:
- ``healthy_s``: the first 200 from ``/health``, which both servers give once their engines serve;
- ``first_answer_s``: the end of one chat completion (16 tokens) sent right after, since a server may be
  healthy before the first request's shapes are compiled.

Caches: a ``cold`` start gets empty compile caches of its own (``VLLM_CACHE_ROOT`` for vLLM's
``torch_compile_cache``, ``TORCHINDUCTOR_CACHE_DIR`` for inductor's kernels), as on a fresh machine or a new
pod without cache volumes; the ``warm`` start after it reuses the caches that start left, as a restart
does. The engine's compile mode is each server's default (both compiled), so the cold start includes
compiling the model.

Within a round one server does its cold start then its warm start, then the other server does the same;
the order of the servers alternates between rounds, and only ratios within a round are reported (this
machine's speed moves within minutes).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics as st
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loadtest.bench_serve import Server, pair_servers, stop

CACHES = ("cold", "warm")
METRICS = ("healthy_s", "first_answer_s")


def cache_env(root: Path) -> dict[str, str]:
    """The compile caches of one server's starts, under ``root`` (empty on its first start)."""
    return {"VLLM_CACHE_ROOT": str(root / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}


def check_caches_written(env: dict[str, str], label: str) -> None:
    """A server that compiled elsewhere (an environment variable not reaching its engine) would make the warm
    start a second cold one: stop rather than publish that. Either directory may stay empty: vLLM's own
    ahead-of-time compilation keeps its inductor kernels under ``VLLM_CACHE_ROOT``."""
    if not any(any(Path(path).rglob("*.so")) for path in env.values()):
        raise RuntimeError(f"{label} left no compiled kernel under {sorted(env.values())} after a cold start: "
                           "its caches are elsewhere")


def first_answer(port: int, model_name: str, timeout: float = 600) -> None:
    body = {"model": model_name, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 16, "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        answer = json.loads(resp.read())
    if not answer["choices"][0]["message"]["content"]:
        raise RuntimeError(f"an empty first answer from port {port}: {answer}")


def measure(server: Server, model_name: str, workdir: Path, log: Path) -> dict[str, float]:
    t0 = time.monotonic()
    proc, healthy = server.start(workdir, log)
    try:
        first_answer(server.port, model_name)
        return {"healthy_s": healthy, "first_answer_s": time.monotonic() - t0}
    finally:
        stop(proc, server.port)


def summarize(cells: list[dict]) -> dict:
    """Per pair, cache state and metric: each round's ours/vllm ratio, their median, and each side's seconds."""
    out: dict = {}
    for pair in dict.fromkeys(c["pair"] for c in cells):
        for cache in CACHES:
            rows = [c for c in cells if c["pair"] == pair and c["cache"] == cache]
            if not rows:
                continue
            entry: dict = {}
            for metric in METRICS:
                by_round: dict[int, dict[str, float]] = {}
                for c in rows:
                    by_round.setdefault(c["round"], {})[c["server"]] = c[metric]
                ratios = [r["ours"] / r["vllm"] for _, r in sorted(by_round.items()) if {"ours", "vllm"} <= set(r)]
                entry[metric] = {"ours": [c[metric] for c in rows if c["server"] == "ours"],
                                 "vllm": [c[metric] for c in rows if c["server"] == "vllm"],
                                 "ratios": ratios, "median_ratio": st.median(ratios) if ratios else None}
            out[f"{pair}/{cache}"] = entry
    return out


def render(result: dict) -> str:
    from loadtest.machine import header

    lines = header(result, "Start-up: our server vs `vllm serve`",
                   f"our dtype for `auto`: {result['machine']['cpu_dtype_auto']}")
    lines += ["Seconds from the server's process start to its first 200 from `/health`, and to the end of a first "
              "16-token chat completion sent right after. `cold`: empty compile caches (a fresh machine or pod); "
              "`warm`: the caches the cold start left (a restart). Ratio: ours / vllm within a round, median "
              f"[min-max] over {result['rounds']} rounds; below 1 we start sooner.", "",
              "| pair / caches | healthy: ratio | first answer: ratio | ours healthy, s | vllm healthy, s "
              "| ours first answer, s | vllm first answer, s |", "|---|---|---|---|---|---|---|"]

    def ratio(values: list[float]) -> str:
        return f"{st.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]" if values else "n/a"

    def seconds(values: list[float]) -> str:
        return ", ".join(f"{v:.0f}" for v in values)

    for key, entry in result["summary"].items():
        h, a = entry["healthy_s"], entry["first_answer_s"]
        lines.append(f"| {key} | {ratio(h['ratios'])} | {ratio(a['ratios'])} | {seconds(h['ours'])} | "
                     f"{seconds(h['vllm'])} | {seconds(a['ours'])} | {seconds(a['vllm'])} |")
    lines += ["", "Servers: " + "; ".join(f"{k}: `{' '.join(v)}`" for k, v in result["servers"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["defaults"], choices=["defaults", "matched"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="docs/results/startup")
    parser.add_argument("--vllm-args", default="", help="more arguments for `vllm serve`, as one string (as in "
                        "bench-serve: what its defaults need to start on the machine)")
    args = parser.parse_args(argv)

    from kernels.hardware import resolve_dtype
    from loadtest.machine import publish
    from workers.model_store import DEFAULT_MODEL, DEFAULT_MODEL_NAME, resolve_model

    model_dir = str(resolve_model(DEFAULT_MODEL))
    dtype = resolve_dtype("auto", False)
    workdir = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    print(f"logs and caches: {workdir}", flush=True)
    cells: list[dict] = []
    servers_seen: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for pair in args.pairs:
            ours, theirs = pair_servers(pair, model_dir, DEFAULT_MODEL_NAME, dtype, shlex.split(args.vllm_args))
            for server in ((theirs, ours) if r % 2 == 0 else (ours, theirs)):
                servers_seen[f"{pair}/{server.label}"] = server.argv + (
                    [f"(config {json.dumps(server.config)})"] if server.config else [])
                caches = workdir / f"cache-{pair}-{server.label}-{r}"
                server.env = {**server.env, **cache_env(caches)}
                for cache in CACHES:  # the warm start reuses what the cold one compiled
                    log = workdir / f"{pair}-{server.label}-{cache}-{r}.log"
                    cell: dict = {**measure(server, DEFAULT_MODEL_NAME, workdir, log),
                                  "pair": pair, "server": server.label, "cache": cache, "round": r}
                    if cache == "cold":
                        check_caches_written(cache_env(caches), server.label)
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
    publish("loadtest.bench_startup", argv, args.out,
            {"rounds": args.rounds, "cells": cells, "servers": servers_seen, "summary": summarize(cells)}, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
