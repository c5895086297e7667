"""What entropy adds to KV pruning: block selectors at equal mean kept fraction, against dense (issue 14, item 1).

    make bench-selectors ARGS="--contexts 2000 4000 7000 --budgets 0.1 0.25 0.5 --out docs/results/selectors"
    make bench-selectors ARGS="--replot --out docs/results/selectors"   # the plots again, from the saved data

Selectors, each at several budgets (``--budgets``: the entropy law's ``keep_min``):

* ``entropy`` (the paper's law, served by default until these results): the entropy-driven budget of
  ``controller.laws.pruning`` (keep fraction between ``keep_min`` at low entropy and everything at high
  entropy, moving at most ``max_step`` a step) with surprisal-weighted Quest scores (``info_weight`` 1);
* ``fixed``: the same scores, a kept fraction fixed from the first decode step at what ``entropy`` kept on
  the same prompts (matched per task and context length, so both read the same number of blocks);
* ``quest``: the same fixed fraction with Quest's bound alone (``info_weight`` 0: no surprisal weighting);
* ``dense``: no pruning, the reference every selector is compared with.

Tasks, each at every context length (filler text or Python's own documentation as natural text), with
``--cases`` prompts apiece (different keys and depths): ``passkey`` (one key at a depth), ``needles``
(three labelled keys at 15/50/85% depth, one asked for), ``distractors`` (the key among five
near-duplicate sentences with other numbers), ``two_part`` (a key split in two halves far apart, both
needed) and ``natural`` (teacher forcing: each selector re-reads dense's greedy continuation of natural
text, and its next-token distribution is compared with dense's: top-1 agreement and KL(dense || pruned)).

Requests go through one replica core (``workers.core.ReplicaCore``, the replica that serves, compiled, with
pruning on and the teacher-forcing instrument of ``loadtest.instruments``), each configuration being the
request's ``entropic.pruning`` overrides. Block surprisal comes from what the engine runner feeds the pruner:
each generated token's logprob and, only with ``--prompt-surprisal`` (prompt logprobs asked for, as a client
can), the prompt's; without it prompt blocks sit at the request's mean surprisal, as served by default, and
are ranked by Quest's bound alone, so ``fixed`` and ``quest`` differ only through generated blocks. Greedy
decoding, so each configuration's output is deterministic: the spread is over prompts, reported as 95%
intervals (Wilson for accuracies, normal for means). Every prompt is prefilled once before any
configuration runs, so all of them decode from the same prefix-cache state. Outputs have a fixed length
(the answer's span): this measures what pruning changes, not where a generation would end.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import pydoc_data.topics
import random
import re
import statistics as st
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench_pruning import keep_overrides
from loadtest.stats import mean_interval, wilson
from loadtest.workload import FILLER, TOKENS_PER_FILLER, passkey_prompt

SELECTORS = ("entropy", "fixed", "quest")
TASKS = ("passkey", "needles", "distractors", "two_part", "natural")
ORDINALS = ("first", "second", "third")


@dataclass(frozen=True)
class Case:
    task: str
    context: int  # target prompt length, tokens
    prompt: str
    answer: str | None  # None: teacher-forced (natural)
    max_tokens: int


def _with_inserts(context: int, inserts: list[tuple[float, str]], intro: str, question: str) -> str:
    parts = [FILLER] * max(1, context // TOKENS_PER_FILLER)
    for depth, sentence in sorted(inserts, reverse=True):  # deepest first, so earlier indices stay put
        parts.insert(int(len(parts) * depth), sentence)
    return intro + "".join(parts) + question


def _natural_text(tokens: int, offset: int) -> str:
    text = re.sub(r"\s+", " ", " ".join(pydoc_data.topics.topics.values()))
    return text[offset: offset + int(tokens * 4.65)]  # ~4.65 characters per token of this text


def make_cases(context: int, cases: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1_000_003 + context)
    out: list[Case] = []
    for i in range(cases):
        depth = (0.2, 0.5, 0.8)[i % 3]
        key = rng.randrange(10_000, 99_999)
        out.append(Case("passkey", context, passkey_prompt(context // TOKENS_PER_FILLER, depth, key), str(key), 8))

        keys = [rng.randrange(10_000, 99_999) for _ in ORDINALS]
        asked = i % 3
        out.append(Case("needles", context, _with_inserts(
            context, [(d, f"The {o} pass key is {k}. ") for d, o, k in zip((0.15, 0.5, 0.85), ORDINALS, keys)],
            "There are three pass keys hidden in this text. Remember them.\n",
            f"What is the {ORDINALS[asked]} pass key? The {ORDINALS[asked]} pass key is"), str(keys[asked]), 8))

        key = rng.randrange(10_000, 99_999)
        decoys = [rng.randrange(10_000, 99_999) for _ in range(5)]
        near = ("The pass code is {}. ", "The spare key is {}. ", "The old pass key was {}. ",
                "A pass key is not {}. ", "The past key is {}. ")
        inserts = [(depth, f"The pass key is {key}. Remember it. ")]
        inserts += [((j + 0.5) / 5, s.format(d)) for j, (s, d) in enumerate(zip(near, decoys))]
        out.append(Case("distractors", context, _with_inserts(
            context, inserts, "There is a pass key hidden in this text, among other numbers. Find it.\n",
            "What is the pass key? The pass key is"), str(key), 8))

        first, second = rng.randrange(100, 999), rng.randrange(100, 999)
        out.append(Case("two_part", context, _with_inserts(
            context, [(0.2, f"Part one of the pass key is {first}. "), (0.8, f"Part two of the pass key is {second}. ")],
            "A pass key in two parts is hidden in this text. Find both parts.\n",
            "The pass key is part one followed by part two. What is the pass key? The pass key is"),
            f"{first}{second}", 12))

        out.append(Case("natural", context, _natural_text(context, 150_000 * i + 7_919 * (context // 1000)), None, 32))
    return out


def correct(case: Case, text: str) -> bool:
    assert case.answer is not None
    return case.answer in re.sub(r"[\s,.-]", "", text)


class Runner:
    """One replica core (``workers.core.ReplicaCore``: the replica that serves, pruning on, sampling control
    and scheduling off) with the teacher-forcing instrument; each configuration is a request's ``entropic``
    overrides, as a client would send them."""

    def __init__(self, args: argparse.Namespace) -> None:
        from loadtest.bench_pruning import core_dtype, make_core
        from loadtest.instruments import TeacherForcing

        self.core = make_core("pruned", model=args.model, batch=args.batch, block_size=args.block_size,
                              threads=args.threads, kv_gib=args.kv_gib, dtype=args.dtype,
                              logits_processors=(TeacherForcing,))
        self.dtype = core_dtype(self.core)
        self.batch = args.batch
        self.prompt_surprisal = args.prompt_surprisal

    async def _one(self, case: Case, overrides: dict, force: list[int] | None) -> tuple[list[int], str, str | None]:
        from deployments.protocol import EntropicCompletionRequest

        key = uuid.uuid4().hex if force else None
        pruned = overrides["pruning"].get("enabled", True)
        request = EntropicCompletionRequest(
            prompt=case.prompt, max_tokens=len(force) if force else case.max_tokens, temperature=0, ignore_eos=True,
            vllm_xargs={"fidelity_key": key, "fidelity_force": force} if force else None,
            prompt_logprobs=0 if self.prompt_surprisal and pruned else None)
        tokens, text = [], []
        async for delta in self.core.generate("completion", request, overrides):
            tokens += delta.token_ids
            text.append(delta.text)
        return tokens, "".join(text), key

    async def run(self, cases: list[Case], pruning: dict | None, force: list[list[int]] | None = None) -> dict:
        """Greedy outputs of ``cases`` under the ``pruning`` overrides (None: dense), in batches; with ``force``,
        each case's tokens forced and its per-position log-probabilities returned."""
        from loadtest.instruments import TeacherForcing
        from workers.pruning_state import STATE

        overrides = {"pruning": pruning if pruning is not None else {"enabled": False}}
        texts, tokens, records = [], [], []
        kept = total = 0
        started = time.perf_counter()
        for lo in range(0, len(cases), self.batch):
            chunk = cases[lo: lo + self.batch]
            before = (STATE.stats.blocks_kept, STATE.stats.blocks_total)
            outs = await asyncio.gather(*(self._one(c, overrides, force[lo + j] if force else None)
                                          for j, c in enumerate(chunk)))
            kept += STATE.stats.blocks_kept - before[0]
            total += STATE.stats.blocks_total - before[1]
            tokens += [t for t, _, _ in outs]
            texts += [x for _, x, _ in outs]
            if force:
                records += [TeacherForcing.records.pop(key) for _, _, key in outs if key is not None]
        return {"texts": texts, "tokens": tokens, "records": records, "seconds": time.perf_counter() - started,
                "kept": kept / total if total else 1.0}


def _forced_metrics(dense: list[dict], pruned: list[dict]) -> tuple[list[float], list[float]]:
    """Per case: top-1 agreement with dense and mean KL(dense || pruned) over forced positions (position 0
    is the prefill's, always dense)."""
    agreement, kl = [], []
    for d_rec, p_rec in zip(dense, pruned):
        positions = [pos for pos in sorted(d_rec) if pos > 0 and pos in p_rec]
        agreement.append(st.fmean(float(d_rec[pos].argmax() == p_rec[pos].argmax()) for pos in positions))
        kl.append(st.fmean(float((d_rec[pos].exp() * (d_rec[pos] - p_rec[pos])).sum()) for pos in positions))
    return agreement, kl


async def measure(args: argparse.Namespace) -> dict:
    runner = Runner(args)
    runner.core.start()
    cases = [c for context in args.contexts for c in make_cases(context, args.cases, args.seed)]
    tokenizer = runner.core.runner.tokenizer
    lengths = {(c.task, c.context): len(tokenizer.encode(c.prompt)) for c in cases}
    await runner.run(cases, None)  # prefill every prompt once: every configuration reads the same prefix cache
    groups = {(t, ctx): [c for c in cases if c.task == t and c.context == ctx] for t in TASKS for ctx in args.contexts}
    groups = {k: v for k, v in groups.items() if v}

    dense = {k: await runner.run(v, None) for k, v in groups.items()}
    forced_tokens = {k: dense[k]["tokens"] for k in groups if k[0] == "natural"}
    dense_forced = {k: await runner.run(groups[k], None, forced_tokens[k]) for k in forced_tokens}

    def evaluate(key: tuple[str, int], result: dict) -> dict:
        group = groups[key]
        row: dict[str, Any] = {"kept": result["kept"], "seconds": result["seconds"]}
        if key[0] == "natural":
            row["agreement"], row["kl"] = _forced_metrics(dense_forced[key]["records"], result["records"])
        else:
            row["correct"] = [correct(c, t) for c, t in zip(group, result["texts"])]
            row["same_as_dense"] = [a == b for a, b in zip(result["tokens"], dense[key]["tokens"])]
        return row

    rows: list[dict] = []
    for key in groups:
        base = dense_forced[key] if key in forced_tokens else dense[key]
        rows.append({"selector": "dense", "budget": None, "task": key[0], "context": key[1],
                     "prompt_tokens": lengths[key], **evaluate(key, base)})
    for budget in args.budgets:
        law = {"budget": "entropy", "keep_min": budget, **({"max_step": args.max_step} if args.max_step is not None else {})}
        for key, group in groups.items():
            force = forced_tokens.get(key)
            ours = await runner.run(group, law, force)
            fixed_overrides = keep_overrides(max(ours["kept"], 1e-3))
            assert fixed_overrides is not None  # None only when no fraction is given
            matched = fixed_overrides["pruning"]
            results = {"entropy": ours, "fixed": await runner.run(group, matched, force),
                       "quest": await runner.run(group, {**matched, "info_weight": 0.0}, force)}
            for selector, result in results.items():
                rows.append({"selector": selector, "budget": budget, "task": key[0], "context": key[1],
                             "prompt_tokens": lengths[key], **evaluate(key, result)})
            print(f"budget {budget} {key}: kept " + ", ".join(f"{s} {r['kept']:.3f}" for s, r in results.items()),
                  file=sys.stderr, flush=True)
    return {"dtype": runner.dtype, "rows": rows}


def summarize(rows: list[dict]) -> list[dict]:
    """Per selector and budget, over contexts and cases: kept fraction, accuracy by task (with Wilson
    intervals), identical-to-dense outputs, and the teacher-forced agreement and KL (with intervals)."""
    out = []
    configs = sorted({(r["selector"], r["budget"]) for r in rows},
                     key=lambda c: (c[1] is not None, c[1] or 0.0, SELECTORS.index(c[0]) if c[0] in SELECTORS else -1))
    for selector, budget in configs:
        mine = [r for r in rows if r["selector"] == selector and r["budget"] == budget]
        entry: dict[str, Any] = {"selector": selector, "budget": budget,
                                 "kept": st.fmean(r["kept"] for r in mine), "accuracy": {}}
        for task in TASKS[:-1]:
            outcomes = [ok for r in mine if r["task"] == task for ok in r["correct"]]
            if outcomes:
                entry["accuracy"][task] = (sum(outcomes) / len(outcomes), *wilson(sum(outcomes), len(outcomes)))
        same = [s for r in mine if r["task"] != "natural" for s in r["same_as_dense"]]
        entry["same_as_dense"] = (sum(same) / len(same), *wilson(sum(same), len(same))) if same else None
        kl = [v for r in mine if r["task"] == "natural" for v in r["kl"]]
        agreement = [v for r in mine if r["task"] == "natural" for v in r["agreement"]]
        entry["kl"] = mean_interval(kl)
        entry["agreement"] = mean_interval(agreement)
        entry["kept_by_context"] = {str(c): st.fmean(r["kept"] for r in mine if r["context"] == c)
                                    for c in sorted({r["context"] for r in mine})}
        entry["kl_by_context"] = {str(c): st.fmean(v for r in mine if r["context"] == c and r["task"] == "natural"
                                                   for v in r["kl"])
                                  for c in sorted({r["context"] for r in mine if r["task"] == "natural"})}
        if selector in ("entropy", "quest"):
            entry["kl_minus_fixed"] = mean_interval(_paired_kl(rows, selector, budget))
        entry["speed_vs_dense"] = _speed_vs_dense(rows, mine)
        out.append(entry)
    return out


def _speed_vs_dense(rows: list[dict], mine: list[dict]) -> float | None:
    """Geometric mean, over the task and context groups, of dense's wall time for the group over this
    configuration's: above 1 is faster than dense."""
    dense = {(r["task"], r["context"]): r["seconds"] for r in rows if r["selector"] == "dense"}
    ratios = [dense[(r["task"], r["context"])] / r["seconds"] for r in mine
              if (r["task"], r["context"]) in dense and r["seconds"] > 0]
    return math.exp(st.fmean(math.log(x) for x in ratios)) if ratios else None


def _paired_kl(rows: list[dict], selector: str, budget: float) -> list[float]:
    """Per natural-text case, ``selector``'s KL minus ``fixed``'s at the same budget, task and context."""
    natural = [r for r in rows if r["budget"] == budget and r["task"] == "natural"]
    fixed = {r["context"]: r["kl"] for r in natural if r["selector"] == "fixed"}
    return [a - b for r in natural if r["selector"] == selector and r["context"] in fixed
            for a, b in zip(r["kl"], fixed[r["context"]], strict=True)]


def _render(result: dict) -> str:
    from loadtest.machine import header

    lines = header(result, "KV pruning: entropy-driven vs fixed budget vs Quest selection at equal kept fraction",
                   f"{result['dtype']}, block {result['block_size']}, compiled, the replica core as served")
    contexts = sorted({r["prompt_tokens"] for r in result["rows"]})
    surprisal = ("prompt blocks carry their tokens' surprisal (prompt logprobs asked for)" if result["prompt_surprisal"]
                 else "prompt blocks at the request's mean surprisal, as served (no prompt logprobs asked for)")
    lines += [f"Prompts of {min(contexts)}-{max(contexts)} tokens (targets {result['contexts']}), {result['cases']} "
              f"cases per task and length, greedy. Budget: the entropy law's keep_min, its max_step "
              f"{result['max_step'] if result['max_step'] is not None else 'the deployment default'}; `fixed` and "
              f"`quest` keep what `entropy` kept on the same prompts; {surprisal}. Intervals: 95% over cases (Wilson "
              "for proportions, normal for means). Accuracy of dense shows which tasks are within this model's "
              "reach. Paired: per natural-text case, the selector's KL minus `fixed`'s at the same budget. Speed: "
              "dense's wall time over the configuration's, per task and length group (geometric mean), in this run; "
              "configurations run one after another, not alternated, and outputs are 8-32 tokens, so this is "
              "mostly what selection costs or saves over a few decode steps, order effects included.", "",
              "| selector | budget | kept | " + " | ".join(TASKS[:-1]) + " | same output as dense | "
              "teacher-forced top-1 agreement | mean KL (nats) | paired KL - fixed's | KL by context | "
              "speed vs dense |",
              "|" + "---|" * (len(TASKS[:-1]) + 9)]

    def proportion(v: Any) -> str:
        return "-" if v is None else f"{v[0]:.2f} [{v[1]:.2f}-{v[2]:.2f}]"

    def mean(v: Any, digits: int) -> str:
        return "-" if v is None or math.isnan(v[0]) else f"{v[0]:.{digits}f} [{v[1]:.{digits}f}-{v[2]:.{digits}f}]"

    for e in result["summary"]:
        by_context = ", ".join(f"{c}: {v:.4f}" for c, v in e["kl_by_context"].items())
        lines.append(f"| {e['selector']} | {e['budget'] if e['budget'] is not None else '-'} | {e['kept']:.3f} | "
                     + " | ".join(proportion(e["accuracy"].get(t)) for t in TASKS[:-1])
                     + f" | {proportion(e['same_as_dense'])} | {mean(e['agreement'], 3)} | {mean(e['kl'], 4)} | "
                     f"{mean(e.get('kl_minus_fixed'), 4)} | {by_context} | "
                     + ("-" if e.get("speed_vs_dense") is None else f"{e['speed_vs_dense']:.2f}x") + " |")
    if result.get("plots"):
        lines += ["", "Quality against the fraction of blocks kept, per selector (95% intervals over cases; dense "
                  "at 1.0):", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in result["plots"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> list[str]:
    """Quality-versus-kept-fraction curves, one per selector: KL from dense and top-1 agreement with it on
    natural text, each point a budget at the fraction it kept."""
    from loadtest.plots import interval_line, save_figure

    rows = result["summary"]
    dense = next(r for r in rows if r["selector"] == "dense")

    def curves(metric: str):
        def draw(ax) -> None:
            for selector in dict.fromkeys(r["selector"] for r in rows if r["selector"] != "dense"):
                points = sorted((r["kept"], r[metric]) for r in rows if r["selector"] == selector)
                # quest and fixed keep the same fraction: offset one a hair so both stay visible
                shift = 0.002 if selector == "quest" else 0.0
                interval_line(ax, [k + shift for k, _ in points], [e for _, e in points], selector)
            ax.plot([dense["kept"]], [dense[metric][0]], "k*", markersize=10, label="dense")
        return draw

    return [save_figure(out, "kl", "KL(dense || pruned) on natural text vs blocks kept", "mean fraction of KV blocks kept",
                        "mean KL per token (nats)", curves("kl")),
            save_figure(out, "agreement", "Top-1 agreement with dense on natural text vs blocks kept",
                        "mean fraction of KV blocks kept", "teacher-forced top-1 agreement", curves("agreement"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2000, 4000, 7000])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--cases", type=int, default=3, help="prompts per task and context length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=int, default=4)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-step", type=float, default=None,
                        help="the entropy law's max_step (default: the deployment's); 1 lets it reach keep_min at once")
    parser.add_argument("--prompt-surprisal", action="store_true",
                        help="pruned requests ask for prompt logprobs, so prompt blocks carry their surprisal "
                        "(each such request is prefilled again: vLLM skips the prefix cache for them)")
    parser.add_argument("--out", default="docs/results/selectors")
    parser.add_argument("--replot", action="store_true", help="measure nothing: draw the plots of the saved "
                        "<out>.json and rewrite <out>.md with them")
    args = parser.parse_args(argv)

    from loadtest.machine import publish

    if args.replot:
        from loadtest.plots import replot

        def summarized(result: dict, path: Path) -> list[str]:  # the summary again too: a pure function of rows
            result["summary"] = summarize(result["rows"])
            return plot(result, path)

        replot(args.out, summarized, _render)
        return 0
    measured = asyncio.run(measure(args))
    summary = summarize(measured["rows"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    plots = plot({"summary": summary}, Path(args.out))
    publish("loadtest.bench_selectors", argv, args.out,
            {"dtype": measured["dtype"], "block_size": args.block_size, "max_step": args.max_step,
             "prompt_surprisal": args.prompt_surprisal,
             "contexts": args.contexts, "cases": args.cases, "budgets": args.budgets,
             "summary": summary, "rows": measured["rows"], "plots": plots}, _render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
