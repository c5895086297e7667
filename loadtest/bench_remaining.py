"""Benchmark: how well the controller's remaining-work predictor knows how long a request will still run,
with and without the entropy features (issue: cluster dispatch, "remaining work predicted, not told").

Requests of the dispatch benchmark's three kinds (short chat, long-context questions, free-form
writing), with many distinct prompts, run through one replica core (``workers.core.ReplicaCore``, the
code that serves, compiled as shipped) and end at EOS or at a loose ``max_tokens``; they are sampled
(temperature 0.7, a seed per request), so one prompt's outputs differ in length. Every telemetry report
the replica sends is kept. Then the reports are replayed into the controller's predictor
(``controller.predictor.RemainingWorkPredictor``, the code the controller runs) once per fold of a
5-fold cross-validation **by prompt**: a fold's prompts are never trained on, so no model can learn a
prompt's length by heart. Each fold gives the held-out mean absolute error, in tokens, of

* ``budget``: max_tokens minus tokens so far (what π used before the predictor);
* ``base``: the regression on prompt length, budget left and tokens so far;
* ``entropy``: ``base`` plus the entropy features (mean and last token entropy, E[ΔH⁺], stop-token mass);
* ``entropy-no-stop``: the same reports with the stop-token mass removed.

    make bench-remaining ARGS="--requests 160"   (writes docs/results/remaining-work.{md,json})
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics as st
import sys
import zlib

from loadtest.bench_dispatch import LOOSE_MAX_TOKENS
from loadtest.workload import CHECKABLE, FILLER, FREE_FORM

FOLDS = 5
_SUBJECTS = ["a comet", "rain", "a violin", "bread", "a glacier", "a volcano", "the moon", "a river", "coffee",
             "a library", "a bridge", "snow", "a bicycle", "honey", "a desert", "thunder"]
_TOPICS = ["a lighthouse", "a fox", "a train", "a garden", "a clockmaker", "a lost key", "an old map", "a storm"]


def make_prompts(n: int, seed: int) -> list[tuple[str, str, int]]:
    """(kind, prompt, prompt group) per request: the dispatch benchmark's mix, with more distinct prompts."""
    rng = random.Random(seed)
    chat = ([f"In one sentence, what is {s}?" for s in _SUBJECTS] + [q for q, _ in CHECKABLE]
            + [f"Explain {s} to a child." for s in _SUBJECTS[:8]])
    free = list(FREE_FORM) + [f"Write a long story about {t}." for t in _TOPICS]
    out = []
    for _ in range(n):
        kind = rng.choices(["chat", "long_context", "free_form"], [0.5, 0.2, 0.3])[0]
        if kind == "chat":
            prompt = rng.choice(chat)
        elif kind == "free_form":
            prompt = rng.choice(free)
        else:
            reps = rng.choice([20, 35, 50, 65])
            prompt = FILLER * reps + f"Question: how many times does the text say the sky is blue? ({reps} filler)"
        out.append((kind, prompt, zlib.crc32(prompt.encode())))
    return out


async def run(core, prompts: list[tuple[str, str, int]], concurrency: int) -> dict[str, dict]:
    from deployments.protocol import EntropicChatCompletionRequest

    gate = asyncio.Semaphore(concurrency)
    ended: dict[str, dict] = {}

    async def one(i: int, kind: str, prompt: str, group: int) -> None:
        key = f"{kind}-{i}"
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": LOOSE_MAX_TOKENS[kind],
                "temperature": 0.7, "seed": i}
        async with gate:
            deltas = [d async for d in core.generate("chat", EntropicChatCompletionRequest(**body), key=key)]
        ended[key] = {"kind": kind, "group": group, "tokens": deltas[-1].completion_tokens,
                      "finish_reason": deltas[-1].finish_reason}

    core.start()
    await asyncio.gather(*(one(i, *p) for i, p in enumerate(prompts)))
    return ended


def cross_validate(reports: list, groups: dict[str, int], strip_stop: bool) -> list[dict[str, float]]:
    """Held-out MAE per model, one entry per fold (folds by prompt group)."""
    from prometheus_client import CollectorRegistry

    from controller.predictor import RemainingWorkPredictor

    if strip_stop:
        reports = [dataclasses.replace(r, summaries={k: dataclasses.replace(s, stop_prob=None)
                                                     for k, s in r.summaries.items()}) for r in reports]
    folds = []
    for fold in range(FOLDS):
        def held_out(key: str, fold: int = fold) -> bool:
            return groups.get(key, 0) % FOLDS == fold

        predictor = RemainingWorkPredictor(CollectorRegistry(), min_samples=1, refit_every=10**9, held_out=held_out)
        for report in reports:
            predictor.observe(report)
        predictor.refit()
        folds.append(dict(predictor.errors))
    return folds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/results/remaining-work")
    args = parser.parse_args(argv)

    from prometheus_client import CollectorRegistry

    from controller.messages import ControllerAnswer
    from loadtest.machine import publish
    from workers.config import EngineConfig, ReplicaConfig
    from workers.core import ReplicaCore

    reports: list = []

    async def controller(report):  # in place of the controller deployment: keep what the replica sends
        reports.append(report)
        return ControllerAnswer(priorities={})

    config = ReplicaConfig(engine=EngineConfig(max_num_seqs=args.concurrency))
    core = ReplicaCore(config, replica_id="remaining", metrics_registry=CollectorRegistry(), controller=controller)
    prompts = make_prompts(args.requests, args.seed)
    try:
        ended = asyncio.run(run(core, prompts, args.concurrency))
    finally:
        core.shutdown()
    groups = {key: e["group"] for key, e in ended.items()}
    results = {"entropy": cross_validate(reports, groups, False),
               "no_stop": cross_validate(reports, groups, True)}
    by_kind = {k: [e["tokens"] for e in ended.values() if e["kind"] == k] for k in LOOSE_MAX_TOKENS}
    publish("loadtest.bench_remaining", argv, args.out,
            {"settings": vars(args), "folds": FOLDS, "loose_max_tokens": LOOSE_MAX_TOKENS,
             "reports": len(reports), "distinct_prompts": len(set(groups.values())),
             "output_tokens": {k: {"n": len(v), "mean": st.mean(v) if v else None, "min": min(v, default=None),
                                   "max": max(v, default=None)} for k, v in by_kind.items()},
             "ended_at_eos": sum(e["finish_reason"] == "stop" for e in ended.values()),
             "fold_errors": results}, _markdown)
    return 0


def _spread(values: list[float]) -> str:
    return f"{st.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def _markdown(result: dict) -> str:
    from loadtest.machine import cpu_text

    m = result["machine"]
    with_stop, no_stop = result["fold_errors"]["entropy"], result["fold_errors"]["no_stop"]
    rows = [("budget (max_tokens - generated)", [f["budget"] for f in with_stop]),
            ("base: prompt, budget, tokens so far", [f["base"] for f in with_stop]),
            ("entropy: base + entropy features + stop-token mass", [f["entropy"] for f in with_stop]),
            ("entropy without the stop-token mass", [f["entropy"] for f in no_stop])]
    lines = ["# Remaining work: held-out error of the controller's predictor, with and without entropy", "",
             f"Command: `{result['command']}`  ", f"Date: {result['date']}  ",
             f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, vLLM {m['vllm']}",
             "", f"{result['settings']['requests']} sampled requests (temperature 0.7), {result['distinct_prompts']} "
             f"distinct prompts, {result['ended_at_eos']} ended at EOS, the rest at max_tokens "
             f"{result['loose_max_tokens']}; {result['reports']} telemetry reports replayed into the predictor. "
             f"{result['folds']}-fold cross-validation by prompt. Mean absolute error of the tokens a request "
             "still generates, over every snapshot (0, 1, 4, 16, 64, ... tokens into each output) of the held-out "
             "requests: median [min-max] over folds.", "",
             "| model | held-out MAE, tokens |", "|---|---|"]
    lines += [f"| {name} | {_spread(values)} |" for name, values in rows]
    ratio = [e["entropy"] / e["base"] for e in with_stop if e["base"]]
    ratio_ns = [e["entropy"] / e["base"] for e in no_stop if e["base"]]
    lines += ["", f"entropy / base per fold: {', '.join(f'{r:.2f}' for r in ratio)} (median {st.median(ratio):.2f}); "
              f"without the stop-token mass: {', '.join(f'{r:.2f}' for r in ratio_ns)} "
              f"(median {st.median(ratio_ns):.2f}).", "", "Output lengths by kind (tokens):", ""]
    for kind, o in result["output_tokens"].items():
        lines.append(f"- {kind}: {o['n']} requests, mean {o['mean']:.0f}, range {o['min']}-{o['max']}"
                     if o["n"] else f"- {kind}: none")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
