"""Fit EPIC's α for a model on held-out text and store it beside the model's weights.

    make fit-epic-alpha ARGS="--out docs/results/epic-alpha"

α* is the root of Lemma 3.2's moment condition, token by token (``controller.laws.epic.fit_alpha_positions``):
at positions t of held-out text (prefixes from the data, p), the mean lookahead entropy H_{t:t+k} of the
token the text has there (μ_p) equals the mean, over the same positions, of E_{y ~ q_α}[H_{t:t+k}(y)] over
q's ``max_candidates`` most likely tokens (μ_α). Every lookahead entropy is estimated by the replica core
that serves (``workers.epic.EpicDecoder.survey``: K rollouts of k tokens through the engine, the
Rao-Blackwellised estimate), with the same horizon, rollouts and candidates a request uses by default.

Held-out text: Python's own documentation (``pydoc_data.topics``, shipped with every Python) at an offset
no test or other benchmark reads. The positions are split by passage: α is fitted on the even passages and
the calibration error |μ_p − μ_α| is reported on the odd ones at α = 0 and at the fitted α, then α is refitted
on all of them. The model's miscalibration μ_p − μ_0 comes with a 95% interval over positions (each lookahead
is a rollout estimate, so the gap carries their noise): where the interval holds 0, the model is calibrated
here as far as this text can tell, and the stored α is 0 rather than a fit to noise. The result goes to
``<model dir>/entropic-epic.json`` (read by the replica at start: ``workers.model_store.fitted_epic_alpha``)
and to ``--out`` (.json, .md).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys

OFFSET = 100_000  # characters into pydoc_data.topics; fidelity tests read 0-12K and 200K-212K, calibration 350K+


def passages(tokenizer, count: int, tokens: int, offset: int = OFFSET) -> list[list[int]]:
    """``count`` consecutive passages of ``tokens`` tokens of Python's documentation from character ``offset``."""
    import pydoc_data.topics

    text = re.sub(r"\s+", " ", " ".join(pydoc_data.topics.topics.values()))[offset:]
    ids = tokenizer.encode(text[: count * tokens * 6], add_special_tokens=False)
    return [ids[i * tokens:(i + 1) * tokens] for i in range(count) if len(ids) >= (i + 1) * tokens]


async def survey(core, passage_ids: list[list[int]], context: int, control, concurrency: int) -> list[list]:
    """Per passage, one ``Position`` per token after the first ``context``."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from controller.laws.epic import Position
    from workers.control_params import SamplingControl

    base = SamplingParams(temperature=1.0, max_tokens=1, output_kind=RequestOutputKind.DELTA)
    gate = asyncio.Semaphore(concurrency)

    async def one(p: int, t: int, ids: list[int]) -> Position:
        key = f"fit-{p}-{t}"
        params = base.clone()
        params.seed = 100_003 * p + t  # the rollouts' draws: a rerun surveys the same continuations
        params.extra_args = SamplingControl(enabled=False).request_args(key, 1.0).into(None)
        async with gate:
            names, logprobs, looks = await core.epic.survey(key, ids[:t], params, control, also=(ids[t],))
        return Position(looks[ids[t]], logprobs, [looks[n] for n in names])

    jobs = [[one(p, t, ids) for t in range(context, len(ids))] for p, ids in enumerate(passage_ids)]
    return [list(await asyncio.gather(*row)) for row in jobs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help='"default" or a local HF model directory')
    parser.add_argument("--passages", type=int, default=6)
    parser.add_argument("--context", type=int, default=64, help="tokens of each passage before the first position")
    parser.add_argument("--positions", type=int, default=32, help="positions per passage")
    parser.add_argument("--concurrency", type=int, default=4, help="positions surveyed at once")
    parser.add_argument("--eager", action="store_true", help="run the engine eager (skips compiling: a quicker start)")
    parser.add_argument("--no-store", action="store_true", help="do not write the fitted value beside the model")
    parser.add_argument("--out", default="docs/results/epic-alpha")
    args = parser.parse_args(argv)

    from prometheus_client import CollectorRegistry

    from controller.laws.epic import fit_alpha_positions, position_mean
    from loadtest.machine import header, publish
    from loadtest.stats import mean_interval
    from workers.config import EngineConfig, ReplicaConfig
    from workers.control_params import EpicControl
    from workers.core import ReplicaCore
    from workers.model_store import EPIC_FIT_FILE, resolve_model

    control = EpicControl(decoding="epic")
    engine = EngineConfig(enforce_eager=True) if args.eager else EngineConfig()
    core = ReplicaCore(ReplicaConfig(model=args.model, engine=engine), replica_id="fit-epic",
                       metrics_registry=CollectorRegistry())
    texts = passages(core.runner.tokenizer, args.passages, args.context + args.positions)
    if len(texts) < 2:
        print("not enough held-out text for two passages", file=sys.stderr)
        return 1

    async def run() -> list[list]:
        core.start()
        return await survey(core, texts, args.context, control, args.concurrency)

    try:
        by_passage = asyncio.run(run())
    finally:
        core.shutdown()
    fit_half = [p for i, row in enumerate(by_passage) if i % 2 == 0 for p in row]
    check_half = [p for i, row in enumerate(by_passage) if i % 2 == 1 for p in row]
    everything = fit_half + check_half
    half = fit_alpha_positions(fit_half)
    full = fit_alpha_positions(everything)

    def error(positions: list, alpha: float) -> float:
        mu_p = sum(p.data_lookahead for p in positions) / len(positions)
        return abs(mu_p - sum(position_mean(p, alpha) for p in positions) / len(positions))

    gap = mean_interval(p.data_lookahead - position_mean(p, 0.0) for p in everything)
    stored = full.alpha if (gap[1] > 0 or gap[2] < 0) and not full.clipped else 0.0
    held_out = {"alpha_fitted_on_even_passages": half.alpha, "error_at_0": error(check_half, 0.0),
                "error_at_fit": error(check_half, half.alpha),
                "data_mean": sum(p.data_lookahead for p in check_half) / len(check_half)}
    fields = {"model": str(resolve_model(args.model)), "horizon": control.horizon, "rollouts": control.rollouts,
              "max_candidates": control.max_candidates, "positions": len(everything), "passages": len(texts),
              "alpha": stored, "fit": full.__dict__, "gap": gap, "held_out": held_out}
    if not args.no_store:
        (resolve_model(args.model) / EPIC_FIT_FILE).write_text(json.dumps(
            {k: fields[k] for k in ("alpha", "horizon", "rollouts", "max_candidates", "positions")}, indent=2))

    def render(result: dict) -> str:
        f, h = result["fit"], result["held_out"]
        lines = header(result, "EPIC: α fitted on held-out text", f"the replica core, "
                       f"{'eager' if args.eager else 'compiled'}; k = {result['horizon']}, K = {result['rollouts']}, "
                       f"{result['max_candidates']} candidates")
        lines += [f"{result['positions']} positions of Python's documentation ({result['passages']} passages, "
                  f"{args.positions} positions each after {args.context} tokens of context). Lookahead entropies in "
                  "nats over the horizon, each one rollout-estimated (so every mean below carries rollout noise).", "",
                  "| | α | μ_p (text) | μ_0 (model) | μ_α (tilted) | clipped |", "|---|---|---|---|---|---|",
                  f"| fit on all positions | {f['alpha']:.4f} | {f['reference_mean']:.3f} | "
                  f"{f['model_mean']:.3f} | {f['fitted_mean']:.3f} | {f['clipped']} |", "",
                  f"Miscalibration μ_p − μ_0: {result['gap'][0]:+.3f} nats, 95% interval [{result['gap'][1]:+.3f}, "
                  f"{result['gap'][2]:+.3f}] over positions. Stored α: {result['alpha']:.4f}"
                  + (" (the interval holds 0: no tilt this text can justify)." if result["alpha"] == 0.0 else "."), "",
                  f"Held out (fitted on the even passages, α = {h['alpha_fitted_on_even_passages']:.4f}; checked on "
                  f"the odd ones, whose text has μ_p = {h['data_mean']:.3f}): calibration error |μ_p − μ| "
                  f"{h['error_at_0']:.3f} nats untilted, {h['error_at_fit']:.3f} at the fitted α.", ""]
        return "\n".join(lines)

    publish("loadtest.fit_epic_alpha", argv, args.out, fields, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
