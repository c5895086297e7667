"""Entropy-stabilized sampling against what users would pick instead, at matched mean entropy (issue 14, item 3).

    make bench-samplers ARGS="--seeds 2 --out docs/results/samplers"

Samplers, each one knob tuned by bisection so that its mean output entropy on the free-form prompts equals
the target (``--target``, nats; by default what fixed temperature ``--reference-t`` gives):

* ``fixed``: plain temperature T (knob T);
* ``dynatemp``: llama.cpp-style dynamic temperature, T scaled with the normalized entropy between T/2 and 3T/2
  (knob T; ``loadtest.samplers.DynamicTemperature``);
* ``mirostat``: mirostat v2 (knob tau, bits; eta 0.1; ``loadtest.samplers.Mirostat2``);
* ``ours``: the served temperature law (``workers.sampling``, cool-only: the request's T = 1 bounds it; knob
  its target entropy H*).

All in one in-process vLLM engine, as logits processors; "output entropy" is the entropy of the
distribution each token was drawn from (``loadtest.samplers.EntropyRecorder``, listed last). Outputs end
at EOS or ``--max-tokens``. Then, per sampler, over ``--seeds`` seed sets of ``--samples`` samples per
prompt: mean and variance of the per-token entropy, 4-gram repetition, distinct-2, self-BLEU-4 across the
samples of a prompt, exact-answer accuracy on one-word factual questions, and the model's own perplexity of
the free-form outputs at temperature 1 (teacher-forced: no judge model). Intervals: 95%, normal over
outputs (over prompts for self-BLEU; Wilson for the accuracy).
"""
from __future__ import annotations

import argparse
import math
import statistics as st
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.stats import interval_cell as cell
from loadtest.stats import mean_interval, wilson
from loadtest.workload import CHECKABLE, FREE_FORM, distinct_n, repetition_rate

SAMPLERS = ("fixed", "dynatemp", "mirostat", "ours")
OFFSET = 5.0  # nats between the stacked traces of the one-output plot
KNOB_RANGE = {"fixed": (0.05, 2.5), "dynatemp": (0.05, 2.5), "mirostat": (0.5, 14.0), "ours": (0.05, 8.0)}


def bleu4(candidate: list[int], references: list[list[int]]) -> float:
    """Sentence BLEU-4 of token ids against references (clipped n-gram precision, add-one smoothing for
    n > 1, brevity penalty against the closest reference length)."""
    if not candidate or not references:
        return 0.0
    log_precision = 0.0
    for n in range(1, 5):
        grams = Counter(tuple(candidate[i:i + n]) for i in range(len(candidate) - n + 1))
        best: Counter = Counter()
        for ref in references:
            for gram, count in Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1)).items():
                best[gram] = max(best[gram], count)
        matched = sum(min(c, best[g]) for g, c in grams.items())
        total = sum(grams.values())
        smooth = 0 if n == 1 else 1
        if total + smooth == 0 or matched + smooth == 0:
            return 0.0
        log_precision += math.log((matched + smooth) / (total + smooth)) / 4
    closest = min((abs(len(r) - len(candidate)), len(r)) for r in references)[1]
    brevity = 1.0 if len(candidate) > closest else math.exp(1 - closest / len(candidate))
    return brevity * math.exp(log_precision)


def self_bleu(samples: list[list[int]]) -> float:
    """Mean BLEU-4 of each sample against the others of the same prompt (high: the samples say the same)."""
    return st.fmean(bleu4(s, samples[:i] + samples[i + 1:]) for i, s in enumerate(samples)) if len(samples) > 1 else 0.0


def sampler_args(sampler: str, knob: float, key: str) -> tuple[float, dict[str, Any]]:
    """(the request's temperature, its extra_args) for ``sampler`` at ``knob``."""
    from loadtest.samplers import KEY
    from workers.control_params import SamplingControl

    extra: dict[str, Any] = {KEY: key}
    if sampler == "fixed":
        return knob, extra
    if sampler == "dynatemp":
        return 1.0, {**extra, "dynatemp_t": knob, "dynatemp_range": 0.5 * knob}
    if sampler == "mirostat":
        return 1.0, {**extra, "mirostat_tau": knob, "mirostat_eta": 0.1}
    if sampler == "ours":  # as workers.prompts sets it up for a request at temperature 1 with control on
        return 1.0, SamplingControl(target_entropy=knob).request_args(key, 1.0).into(extra)
    raise ValueError(sampler)


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        from workers.engine import configure_process_env

        configure_process_env(args.threads, args.kv_gib)
        from vllm import LLM

        from kernels.hardware import resolve_dtype
        from loadtest.samplers import DynamicTemperature, EntropyRecorder, Mirostat2
        from workers.model_store import resolve_model
        from workers.sampling import EntropicLogitsProcessor

        self.llm = LLM(model=str(resolve_model(args.model)), enforce_eager=True,
                       dtype=resolve_dtype(args.dtype, on_gpu=False), max_model_len=2048,
                       max_num_seqs=args.batch, seed=0,
                       logits_processors=[EntropicLogitsProcessor, DynamicTemperature, Mirostat2, EntropyRecorder])
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        tokenizer = self.llm.get_tokenizer()
        self.free = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                   tokenize=False) for p in FREE_FORM]
        self.factual = [(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                       tokenize=False), a) for q, a in CHECKABLE]

    def sample(self, sampler: str, knob: float, prompts: list[str], samples: int, seed: int,
               max_tokens: int) -> list[dict]:
        """``samples`` outputs per prompt; each with its tokens, text and per-token entropies."""
        from vllm import SamplingParams

        from loadtest.samplers import EntropyRecorder, Mirostat2

        batch, keys = [], []
        for i, prompt in enumerate(prompts):
            for j in range(samples):
                key = uuid.uuid4().hex
                temperature, extra = sampler_args(sampler, knob, key)
                batch.append((prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                     seed=seed * 100_003 + i * 101 + j, extra_args=extra)))
                keys.append((i, key))
        outs = self.llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
        results = []
        for (i, key), out in zip(keys, outs):
            entropy = EntropyRecorder.records.pop(key, [])
            Mirostat2.state.pop(key, None)
            tokens = list(out.outputs[0].token_ids)
            results.append({"prompt": i, "prompt_ids": list(out.prompt_token_ids), "tokens": tokens,
                            "text": out.outputs[0].text, "entropy": entropy[: len(tokens)]})
        return results

    def perplexity(self, prompt_ids: list[int], tokens: list[int]) -> float:
        """exp(mean -log p) of ``tokens`` after the prompt under the model at temperature 1 (teacher-forced)."""
        from vllm import SamplingParams

        if not tokens:
            return math.nan
        out = self.llm.generate([{"prompt_token_ids": prompt_ids + tokens}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        scored = out.prompt_logprobs[len(prompt_ids):]
        nll = [-entry[t].logprob for entry, t in zip(scored, tokens) if entry is not None and t in entry]
        return math.exp(st.fmean(nll)) if nll else math.nan


def mean_entropy(outputs: list[dict]) -> float:
    return st.fmean(h for o in outputs for h in o["entropy"] if not math.isnan(h))


def tune(runner: Runner, sampler: str, target: float, args: argparse.Namespace) -> tuple[float, float]:
    """The knob whose mean entropy on the free-form prompts is the target (bisection; the mean entropy rises
    with each knob), and the mean entropy it gave."""
    lo, hi = KNOB_RANGE[sampler]
    best = (math.inf, lo, math.nan)
    for _ in range(args.bisect_steps):
        mid = 0.5 * (lo + hi)
        h = mean_entropy(runner.sample(sampler, mid, runner.free, args.tune_samples, 999, args.max_tokens))
        best = min(best, (abs(h - target), mid, h))
        print(f"tune {sampler}: knob {mid:.4f} -> mean entropy {h:.4f} (target {target:.4f})", file=sys.stderr,
              flush=True)
        lo, hi = (mid, hi) if h < target else (lo, mid)
    return best[1], best[2]


def evaluate(runner: Runner, sampler: str, knob: float, args: argparse.Namespace) -> dict:
    free, factual = [], []
    for seed in range(args.seeds):
        free += [{**o, "seed": seed} for o in runner.sample(sampler, knob, runner.free, args.samples, seed,
                                                             args.max_tokens)]
        answers = runner.sample(sampler, knob, [p for p, _ in runner.factual], args.samples, seed, 16)
        factual += [{**o, "correct": runner.factual[o["prompt"]][1] in o["text"].lower()} for o in answers]
    for o in free:
        o["perplexity"] = runner.perplexity(o["prompt_ids"], o["tokens"])
    groups: dict[tuple[int, int], list[list[int]]] = {}
    for o in free:
        groups.setdefault((o["seed"], o["prompt"]), []).append(o["tokens"])
    correct = sum(o["correct"] for o in factual)
    return {
        "knob": knob,
        "mean_entropy": mean_interval([st.fmean(o["entropy"]) for o in free if o["entropy"]]),
        "entropy_variance": mean_interval([st.pvariance(o["entropy"]) for o in free if len(o["entropy"]) > 1]),
        "repetition_4gram": mean_interval([repetition_rate(o["tokens"], 4) for o in free]),
        "distinct_2": mean_interval([distinct_n(o["tokens"], 2) for o in free]),
        "self_bleu": mean_interval([self_bleu(g) for g in groups.values()]),
        "factual_accuracy": (correct / len(factual), *wilson(correct, len(factual))),
        "perplexity": mean_interval([o["perplexity"] for o in free]),
        "output_tokens": st.fmean(len(o["tokens"]) for o in free),
        "samples": [{k: o[k] for k in ("seed", "prompt", "text")} for o in free[: len(runner.free)]],
        "entropy_trajectory": trajectory([o["entropy"] for o in free]),
        "first_output_entropy": free[0]["entropy"],  # seed 0, prompt 0, first sample: the same draw for each sampler
    }


def trajectory(series: list[list[float]]) -> dict[str, list[float]]:
    """Per token position: the mean and standard deviation of the entropy over the outputs that reached it
    (positions fewer than half of them reached are left out)."""
    means, sds = [], []
    for i in range(max(map(len, series), default=0)):
        values = [h[i] for h in series if len(h) > i and not math.isnan(h[i])]
        if 2 * len(values) < len(series) or len(values) < 2:
            break
        means.append(st.fmean(values))
        sds.append(st.stdev(values))
    return {"mean": means, "sd": sds}


def plot(result: dict, out: Path) -> list[str]:
    """Entropy trajectories per sampler: the mean over outputs with a one-sd band, and one output's own."""
    from loadtest.plots import save_figure

    rows = {name: r for name, r in result["samplers"].items() if "entropy_trajectory" in r}

    def mean(ax) -> None:
        for name, r in rows.items():
            m, sd = r["entropy_trajectory"]["mean"], r["entropy_trajectory"]["sd"]
            (line,) = ax.plot(m, label=name)
            ax.fill_between(range(len(m)), [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)],
                            color=line.get_color(), alpha=0.12)
        ax.axhline(result["target"], color="grey", lw=1, ls="--", label="target mean")

    def one(ax) -> None:  # stacked, each trace raised by OFFSET, so that four jagged lines stay readable
        for i, (name, r) in enumerate(rows.items()):
            (line,) = ax.plot([h + i * OFFSET for h in r["first_output_entropy"]], label=name, lw=1)
            ax.axhline(i * OFFSET, color=line.get_color(), lw=0.5, ls=":")

    return [save_figure(out, "entropy", "Entropy per generated token, mean over outputs (band: one sd)",
                        "generated token", "entropy of the sampled distribution (nats)", mean),
            save_figure(out, "entropy-one-output", "Entropy per generated token, one output per sampler "
                        "(same prompt and seed)", "generated token",
                        f"entropy (nats), raised {OFFSET:g} per sampler", one)]


def _render(result: dict) -> str:
    from loadtest.machine import header

    lines = header(result, "Sampling: the entropy law vs fixed temperature, dynamic temperature and mirostat v2 "
                   "at matched mean entropy", f"{result['dtype']}, eager")
    lines += [f"Target mean entropy {result['target']:.3f} nats (fixed temperature {result['reference_t']} on the "
              f"free-form prompts). {len(FREE_FORM)} free-form prompts x {result['samples']} samples x {result['seeds']} "
              f"seed sets, up to {result['max_tokens']} tokens, ending at EOS; {len(CHECKABLE)} one-word factual "
              "questions with as many samples. 95% intervals.", "",
              "| sampler | knob | mean entropy | entropy variance (per output) | 4-gram repetition | distinct-2 | "
              "self-BLEU-4 | factual accuracy | perplexity at T=1 | mean output tokens |",
              "|---|---|---|---|---|---|---|---|---|---|"]

    for name in SAMPLERS:
        r = result["samplers"][name]
        lines.append(f"| {name} | {r['knob']:.3f} | {cell(r['mean_entropy'])} | {cell(r['entropy_variance'])} | "
                     f"{cell(r['repetition_4gram'])} | {cell(r['distinct_2'])} | {cell(r['self_bleu'])} | "
                     f"{cell(r['factual_accuracy'], 2)} | {cell(r['perplexity'], 2)} | {r['output_tokens']:.0f} |")
    lines += ["", "Knobs: fixed and dynatemp T, mirostat tau (bits), ours the target entropy H* (nats)."]
    if result.get("plots"):
        lines += ["", "Entropy trajectories per sampler:", ""] + [f"![{Path(p).stem}]({Path(p).name})"
                                                                  for p in result["plots"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=None, help="mean entropy to match, nats")
    parser.add_argument("--reference-t", type=float, default=0.7, help="the target, when not given: fixed T's")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt and seed set")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tune-samples", type=int, default=2)
    parser.add_argument("--bisect-steps", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=2)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto", help='"auto": as the server resolves it (float32 on CPUs '
                        "without native bf16)")
    parser.add_argument("--out", default="docs/results/samplers")
    parser.add_argument("--replot", action="store_true", help="measure nothing: draw the plots of the saved "
                        "<out>.json and rewrite <out>.md with them")
    args = parser.parse_args(argv)
    if args.replot:
        from loadtest.plots import replot

        replot(args.out, plot, _render)
        return 0

    from loadtest.machine import publish

    runner = Runner(args)
    target = args.target
    if target is None:
        target = mean_entropy(runner.sample("fixed", args.reference_t, runner.free, args.tune_samples, 999,
                                           args.max_tokens))
    results = {}
    for sampler in SAMPLERS:
        knob, tuned = tune(runner, sampler, target, args)
        results[sampler] = {**evaluate(runner, sampler, knob, args), "tuned_entropy": tuned}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    plots = plot({"samplers": results, "target": target}, Path(args.out))
    publish("loadtest.bench_samplers", argv, args.out,
            {"dtype": runner.dtype, "target": target, "reference_t": args.reference_t, "samples": args.samples,
             "seeds": args.seeds, "max_tokens": args.max_tokens, "samplers": results, "plots": plots}, _render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
