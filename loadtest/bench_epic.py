"""EPIC against the samplers users pick instead: calibration, diversity, accuracy and cost (issue 17).

    make bench-epic ARGS="--out docs/results/epic"

Everything runs through one replica core, the code that serves (``workers.core.ReplicaCore``: requests as
its completion and chat endpoints take them, EPIC as ``workers.epic`` runs it), with the typical-sampling
processor of ``loadtest.samplers`` added to its engine, since vLLM has none.

Data: passages of Python's documentation at an offset nothing else reads; each passage's first
``--context`` tokens are a prompt, its next ``--length`` tokens the reference continuation.

Calibration (the EPIC paper's Figure 4; the entropy rate of Braverman et al. 2020): the reference
cross-entropy CE is the model's mean −log q per token of the reference continuations, q being the model at
temperature 1 with nothing truncated; a method's entropy rate is the same mean over its own continuations of
the same prompts, which end at EOS or after ``--length`` tokens. Calibration error: |rate − CE|, the 95%
interval of rate − CE over the prompts beside it.

Each method has one knob, tuned on the even passages (``--bisect-steps`` of bisection, EPIC's fewer, on rate
− CE, whose sign the knob moves monotonically; the value nearest CE is kept) and evaluated on the odd ones,
in ``--rounds`` rounds of fresh seeds that alternate the order of the methods. Methods: temperature, top-k,
top-p, min-p (vLLM's), typical (``loadtest.samplers``), the entropy law (``workers.sampling``; knob H*,
cool-only under the request's T = 1) and EPIC (knob α, at the defaults of its other fields; also at the α
fitted for the model, ``make fit-epic-alpha``, as served).
"plain" is temperature 1 with nothing else: the cost reference.

Also per method on the held-out passages: 4-gram repetition, distinct-2 and self-BLEU-4 across a prompt's
samples; exact-answer accuracy on the one-word factual questions of ``loadtest.workload.CHECKABLE`` (the
first ``--questions``, all by default; chat template, 16 tokens, Wilson interval); cost: wall time per output
token against plain's in the same round at the same concurrency, and for EPIC the candidates evaluated and
rollout tokens per output token from its telemetry.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import statistics as st
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench_samplers import self_bleu
from loadtest.fit_epic_alpha import passages
from loadtest.stats import interval_cell as cell
from loadtest.stats import mean_interval, wilson
from loadtest.workload import CHECKABLE, distinct_n, repetition_rate

OFFSET = 280_000  # characters into pydoc_data.topics (433K); fit-epic-alpha reads 100K+, fidelity tests 0-12K and
# 200K-212K, calibration-stress 350K+


@dataclass(frozen=True)
class Method:
    name: str
    knob_name: str
    low: float  # the knob's range for the bisection
    high: float
    rising: bool = True  # whether the entropy rate rises with the knob
    log_scale: bool = False  # bisect log(knob): where the rate moves most near the low end (top-k, min-p)

    def request(self, knob: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the request's OpenAI fields, its ``entropic`` object) at ``knob``."""
        off = {"enabled": False}  # the temperature law off: vLLM's own sampling, as `vllm serve` gives it
        if self.name == "plain":
            return {"temperature": 1.0}, off
        if self.name == "temperature":
            return {"temperature": knob}, off
        if self.name == "top-k":
            return {"temperature": 1.0, "top_k": round(knob)}, off
        if self.name == "top-p":
            return {"temperature": 1.0, "top_p": knob}, off
        if self.name == "min-p":
            return {"temperature": 1.0, "min_p": knob}, off
        if self.name == "typical":
            return {"temperature": 1.0, "vllm_xargs": {"typical_p": knob}}, off
        if self.name == "entropy law":
            return {"temperature": 1.0}, {"enabled": True, "target_entropy": knob}
        if self.name in ("epic", "epic fitted"):
            return {"temperature": 1.0}, {"decoding": "epic"} | ({} if math.isnan(knob) else {"alpha": knob})
        raise ValueError(self.name)

    @property
    def tuned(self) -> bool:
        return self.low < self.high

    def middle(self, lo: float, hi: float) -> float:
        mid = math.sqrt(lo * hi) if self.log_scale else 0.5 * (lo + hi)
        return float(round(mid)) if self.name == "top-k" else mid


def methods(alpha_range: tuple[float, float]) -> list[Method]:
    fixed = math.nan  # not tuned: "plain" is the reference, "epic fitted" serves the α fitted for the model
    return [Method("plain", "T", 1.0, 1.0), Method("temperature", "T", 0.5, 1.3),
            Method("top-k", "k", 2, 1000, log_scale=True), Method("top-p", "p", 0.5, 1.0),
            Method("min-p", "min p", 1e-5, 0.2, rising=False, log_scale=True), Method("typical", "mass", 0.5, 1.0),
            Method("entropy law", "H*", 0.5, 6.0), Method("epic", "α", *alpha_range, rising=False),
            Method("epic fitted", "α", fixed, fixed)]


class Bench:
    def __init__(self, core: Any, args: argparse.Namespace) -> None:
        self.core, self.args = core, args
        self.gate = asyncio.Semaphore(args.concurrency)
        self.tokenizer = core.runner.tokenizer

    async def generate(self, kind: str, prompt: Any, method: Method, knob: float, seed: int,
                       max_tokens: int) -> dict:
        from deployments.protocol import REQUEST_MODELS

        fields, entropic = method.request(knob)
        body = {"max_tokens": max_tokens, "seed": seed, **fields,
                **({"messages": prompt} if kind == "chat" else {"prompt": prompt})}
        async with self.gate:
            deltas = [d async for d in self.core.generate(kind, REQUEST_MODELS[kind](**body), dict(entropic))]
        steps = [s for d in deltas for s in (d.epic or [])]
        return {"tokens": [t for d in deltas for t in d.token_ids], "text": "".join(d.text for d in deltas),
                "candidates": sum(s.candidates_evaluated for s in steps),
                "rollout_tokens": sum(s.rollout_tokens for s in steps), "inexact": sum(not s.exact for s in steps)}

    async def nll(self, prompt: list[int], tokens: list[int]) -> list[float]:
        """−log q of each of ``tokens`` after ``prompt`` under the model at temperature 1 (teacher-forced)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        from workers.control_params import SamplingControl

        if not tokens:
            return []
        key = f"score-{id(tokens)}-{time.monotonic_ns()}"
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA)
        params.extra_args = SamplingControl(enabled=False).request_args(key, 1.0).into(None)
        ids = prompt + tokens
        async with self.gate:
            deltas = [d async for d in self.core.runner.generate(key, {"prompt_token_ids": ids}, params, len(ids))]
        scored = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs)[len(prompt):]
        return [-next(lp for tid, lp, *_ in entry if tid == t) for entry, t in zip(scored, tokens, strict=True)]

    async def continuations(self, texts: list[list[int]], method: Method, knob: float, seed: int) -> list[dict]:
        """``--samples`` continuations of each passage's prompt, each scored by the model."""
        context, length, samples = self.args.context, self.args.length, self.args.samples
        jobs = [self.generate("completion", ids[:context], method, knob, seed * 1_000_003 + p * 101 + j, length)
                for p, ids in enumerate(texts) for j in range(samples)]
        outs = await asyncio.gather(*jobs)
        nlls = await asyncio.gather(*(self.nll(texts[i // samples][:context], o["tokens"]) for i, o in enumerate(outs)))
        return [{**o, "passage": i // samples, "nll": n} for i, (o, n) in enumerate(zip(outs, nlls))]

    async def reference(self, texts: list[list[int]]) -> list[float]:
        """Per passage: the model's mean −log q per token of the text's own continuation."""
        context = self.args.context
        return [st.fmean(n) for n in await asyncio.gather(*(self.nll(ids[:context], ids[context:]) for ids in texts))]

    async def answers(self, method: Method, knob: float, seed: int) -> list[bool]:
        questions = CHECKABLE[: self.args.questions]
        jobs = [self.generate("chat", [{"role": "user", "content": q}], method, knob, seed * 7919 + i * 31 + j, 16)
                for i, (q, _) in enumerate(questions) for j in range(self.args.samples)]
        outs = await asyncio.gather(*jobs)
        return [questions[i // self.args.samples][1] in o["text"].lower() for i, o in enumerate(outs)]


def rate_gap(outs: list[dict], reference: list[float]) -> list[float]:
    """Per passage: the entropy rate of its continuations (pooled over tokens) minus its reference CE."""
    by_passage: dict[int, list[float]] = {}
    for o in outs:
        by_passage.setdefault(o["passage"], []).extend(o["nll"])
    return [st.fmean(n) - reference[p] for p, n in sorted(by_passage.items()) if n]


async def run(bench: Bench, texts: list[list[int]], all_methods: list[Method], rounds: int) -> dict:
    tune_texts, test_texts = texts[0::2], texts[1::2]
    tune_ref, test_ref = await bench.reference(tune_texts), await bench.reference(test_texts)
    print(f"reference CE: tuning {st.fmean(tune_ref):.3f}, held out {st.fmean(test_ref):.3f} nats/token",
          file=sys.stderr, flush=True)
    tuning: dict[str, list[dict]] = {}
    for method in all_methods:
        rows = tuning[method.name] = []
        lo, hi = method.low, method.high
        steps = bench.args.epic_bisect_steps if method.name == "epic" else bench.args.bisect_steps
        for _ in range(steps if method.tuned else 1):
            knob = method.middle(lo, hi) if method.tuned else method.low
            gaps = rate_gap(await bench.continuations(tune_texts, method, knob, seed=0), tune_ref)
            rows.append({"knob": knob, "gap": mean_interval(gaps)})
            print(f"tune {method.name} {method.knob_name}={knob:.4g}: rate - CE {rows[-1]['gap'][0]:+.3f}",
                  file=sys.stderr, flush=True)
            if (rows[-1]["gap"][0] < 0) == method.rising:
                lo = knob
            else:
                hi = knob
    chosen = {m.name: min(tuning[m.name], key=lambda r: abs(r["gap"][0]))["knob"] for m in all_methods}
    evaluated: dict[str, dict[str, list]] = {m.name: {"outs": [], "correct": [], "wall_per_token": []}
                                              for m in all_methods}
    for r in range(rounds):
        order = all_methods if r % 2 == 0 else all_methods[::-1]
        for method in order:
            start = time.perf_counter()
            outs = await bench.continuations(test_texts, method, chosen[method.name], seed=1 + r)
            wall = time.perf_counter() - start  # generation and scoring: scoring costs every method the same
            row = evaluated[method.name]
            row["outs"] += [{**o, "round": r} for o in outs]
            row["wall_per_token"].append(wall / max(1, sum(len(o["tokens"]) for o in outs)))
            row["correct"] += await bench.answers(method, chosen[method.name], seed=1 + r)
            print(f"round {r} {method.name}: {wall:.1f} s", file=sys.stderr, flush=True)
    plain = evaluated["plain"]["wall_per_token"]
    results = {}
    for method in all_methods:
        row = evaluated[method.name]
        outs, correct = row["outs"], row["correct"]
        tokens = sum(len(o["tokens"]) for o in outs)
        gaps = rate_gap(outs, test_ref)
        groups: dict[tuple[int, int], list[list[int]]] = {}
        for o in outs:
            groups.setdefault((o["round"], o["passage"]), []).append(o["tokens"])
        cost = [w / p for w, p in zip(row["wall_per_token"], plain, strict=True)]
        results[method.name] = {
            "knob": chosen[method.name], "knob_name": method.knob_name,
            "rate_minus_ce": mean_interval(gaps), "calibration_error": abs(st.fmean(gaps)),
            "entropy_rate": st.fmean(n for o in outs for n in o["nll"]),
            "repetition_4gram": mean_interval(repetition_rate(o["tokens"], 4) for o in outs),
            "distinct_2": mean_interval(distinct_n(o["tokens"], 2) for o in outs),
            "self_bleu": mean_interval(self_bleu(g) for g in groups.values()),
            "accuracy": (sum(correct) / len(correct), *wilson(sum(correct), len(correct))),
            "wall_vs_plain": (st.median(cost), min(cost), max(cost)),
            "candidates_per_token": sum(o["candidates"] for o in outs) / max(1, tokens),
            "rollout_tokens_per_token": sum(o["rollout_tokens"] for o in outs) / max(1, tokens),
            "inexact_tokens": sum(o["inexact"] for o in outs), "output_tokens": tokens,
            "ended_at_eos": sum(len(o["tokens"]) < bench.args.length for o in outs) / len(outs),
            "examples": [bench.tokenizer.decode(o["tokens"]) for o in outs[: 2]],
        }
    return {"reference_ce": {"tuning": st.fmean(tune_ref), "held_out": st.fmean(test_ref)},
            "tuning": tuning, "methods": results}


def _plot(result: dict, out: Path) -> list[str]:
    from loadtest.plots import save_figure

    rows = result["methods"]
    names = list(rows)
    gaps = [rows[n]["rate_minus_ce"] for n in names]

    def calibration(ax) -> None:
        ax.errorbar(range(len(names)), [g[0] for g in gaps],
                    yerr=[[g[0] - g[1] for g in gaps], [g[2] - g[0] for g in gaps]], fmt="o", capsize=4,
                    label="mean and 95% interval over prompts")
        ax.axhline(0.0, color="grey", lw=1)
        ax.set_xticks(range(len(names)), [f"{n}\n{rows[n]['knob_name']}={rows[n]['knob']:.3g}" for n in names],
                      fontsize=7)

    def tuning(ax) -> None:
        for name, tuned in result["tuning"].items():
            if len(tuned) > 1:
                points = sorted((r["knob"], r["gap"][0]) for r in tuned)
                lo, hi = points[0][0], points[-1][0]
                ax.plot([(k - lo) / (hi - lo) for k, _ in points], [g for _, g in points], marker="o", label=name)
        ax.axhline(0.0, color="grey", lw=1)

    return [save_figure(out, "calibration", "Calibration on held-out passages (95%)", "",
                        "entropy rate − reference CE (nats/token)", calibration),
            save_figure(out, "tuning", "Tuning passages: each method's knob",
                        "knob, scaled to the values bisection tried (0: lowest, 1: highest)",
                        "entropy rate − CE (nats/token)", tuning)]


def _render(result: dict) -> str:
    from loadtest.machine import header

    lines = header(result, "EPIC against temperature, top-k, top-p, min-p, typical and the entropy law",
                   f"the replica core, {result['engine']}, {result['dtype']}"
                   + (f", KV blocks of {result['block_size']} tokens" if "block_size" in result else ""))
    ce = result["reference_ce"]
    lines += [f"{result['passages']} passages of Python's documentation ({result['context']}-token prompts; even "
              f"passages tune each knob, odd ones are held out), {result['samples']} samples per prompt and round, "
              f"{result['rounds']} rounds, outputs end at EOS or {result['length']} tokens; "
              f"{result.get('questions', len(CHECKABLE))} one-word questions x {result['samples']} samples per round "
              f"for accuracy; concurrency {result['concurrency']}. "
              f"Reference cross-entropy of the text: {ce['tuning']:.3f} (tuning), {ce['held_out']:.3f} (held out) "
              "nats/token. 95% intervals over prompts (rate − CE, diversity), Wilson (accuracy); cost: median "
              "[min-max] over rounds of the wall time per output token over plain's in the same round.", "",
              "| method | knob | entropy rate − CE | calibration error | 4-gram repetition | distinct-2 | self-BLEU-4 | "
              "accuracy | wall per token vs plain | candidates / token | rollout tokens / token | ended at EOS |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    for name, r in result["methods"].items():
        knob = result["fitted_alpha"] if math.isnan(r["knob"]) else r["knob"]
        lines.append(f"| {name} | {r['knob_name']} = {knob:.3g} | {r['rate_minus_ce'][0]:+.3f} "
                     f"[{r['rate_minus_ce'][1]:+.3f}, {r['rate_minus_ce'][2]:+.3f}] | {r['calibration_error']:.3f} | "
                     f"{cell(r['repetition_4gram'])} | {cell(r['distinct_2'])} | {cell(r['self_bleu'])} | "
                     f"{cell(r['accuracy'], 2)} | {cell(r['wall_vs_plain'], 2)}x | {r['candidates_per_token']:.2f} | "
                     f"{r['rollout_tokens_per_token']:.2f} | {r['ended_at_eos']:.2f} |")
    best = min(result["methods"].items(), key=lambda kv: kv[1]["calibration_error"])
    fitted = (" 'epic fitted' runs at the α the replica serves by default "
              f"({result['fitted_alpha']:.3g}, from `make fit-epic-alpha`).") if "epic fitted" in result["methods"] else ""
    lines += ["", f"Lowest calibration error: {best[0]} ({best[1]['calibration_error']:.3f}); the intervals beside "
              "each say which differences the held-out prompts can tell apart." + fitted, "",
              "Tuning (even passages): entropy rate − CE at each knob value bisection tried, in order", "",
              "| method | " + "knob: rate − CE |", "|---|---|"]
    for name, tuned in result["tuning"].items():
        lines.append(f"| {name} | " + ", ".join(f"{r['knob']:.3g}: {r['gap'][0]:+.3f}" for r in tuned) + " |")
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in result["plots"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help='"default" or a local HF model directory')
    parser.add_argument("--passages", type=int, default=16, help="half tune the knobs, half are held out")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per passage")
    parser.add_argument("--length", type=int, default=32, help="reference tokens per passage; the outputs' cap")
    parser.add_argument("--samples", type=int, default=2, help="continuations per prompt and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--alpha-range", type=float, nargs=2, default=[-1.5, 1.5], help="EPIC's knob, bisected")
    parser.add_argument("--bisect-steps", type=int, default=7, help="per method, on the tuning passages")
    parser.add_argument("--epic-bisect-steps", type=int, default=4, help="EPIC's (each costs many rollouts)")
    parser.add_argument("--methods", nargs="+", default=None, help="a subset of the methods (plain always runs)")
    parser.add_argument("--questions", type=int, default=len(CHECKABLE), choices=range(1, len(CHECKABLE) + 1),
                        metavar=f"1..{len(CHECKABLE)}", help="how many of the factual questions each method answers "
                        "per round, from the first")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="run the engine eager (skips compiling: a quicker start)")
    parser.add_argument("--block-size", type=int, default=None, help="the engine's KV block size (default: the "
                        "served one); the prefix cache reuses whole blocks, so each EPIC engine request prefills "
                        "its prefix's last partial block again")
    parser.add_argument("--out", default="docs/results/epic")
    args = parser.parse_args(argv)

    from prometheus_client import CollectorRegistry

    from loadtest.machine import publish
    from loadtest.samplers import Typical
    from workers.config import EngineConfig, ReplicaConfig
    from workers.core import ReplicaCore

    chosen = [m for m in methods((args.alpha_range[0], args.alpha_range[1]))
              if args.methods is None or m.name == "plain" or m.name in args.methods]
    engine = EngineConfig(enforce_eager=args.eager, block_size=args.block_size)
    core = ReplicaCore(ReplicaConfig(model=args.model, engine=engine), replica_id="bench-epic",
                       metrics_registry=CollectorRegistry(), logits_processors=(Typical,))
    bench = Bench(core, args)
    texts = passages(core.runner.tokenizer, args.passages, args.context + args.length, OFFSET)
    if len(texts) < 2:
        print("not enough held-out text for two passages", file=sys.stderr)
        return 1

    async def go() -> dict:
        core.start()
        return await run(bench, texts, chosen, args.rounds)

    try:
        fields = asyncio.run(go())
    finally:
        dtype = str(core.runner.engine.model_config.dtype).removeprefix("torch.")
        block_size = core.block_size
        fitted = core.epic_alpha
        core.shutdown()
    fields |= {"engine": "eager" if args.eager else "compiled", "dtype": dtype, "block_size": block_size,
               "fitted_alpha": fitted,
               "passages": len(texts), "context": args.context, "length": args.length, "samples": args.samples,
               "questions": args.questions, "rounds": args.rounds, "concurrency": args.concurrency}
    fields["plots"] = _plot(fields, Path(args.out))
    publish("loadtest.bench_epic", argv, args.out, fields, _render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
