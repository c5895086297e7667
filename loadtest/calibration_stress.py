"""Paper §6.2 calibration stress: logit scaling, with and without T_cal and the H_min / B_min guards.

    make calibration-stress             (writes docs/results/calibration.{md,json})

Miscalibration is induced by multiplying the logits by s before anything reads them
(``loadtest.instruments.LogitScale``): s > 1 overconfident (entropy drops, argmax unchanged), s < 1
underconfident. For each s:

1. T_cal is fitted post hoc (``controller.laws.calibration``) on held-out real text (Python's own
   documentation, an offset no test or prompt uses): the NLL-minimising temperature of the scaled
   logits of the default model (transformers, float32).
2. On the replica that serves (``workers.core.ReplicaCore``: our pruned backend, greedy decoding, passkeys
   hidden at three depths in
   ~4K and ~7K tokens of filler, one warm prefix cache for every run), five runs: dense, and
   pruning under an aggressive law with no guard, with the guards (H_min, B_min), with T_cal, with
   both. Reported: passkey accuracy, fraction of KV blocks attended (pruning aggressiveness), and the
   mean and standard deviation of the entropy the control layers read (trajectory stability).
"""
from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics as st

from controller.laws.calibration import fit_temperature
from loadtest.workload import passkey_prompt
from workers.control_params import PruningControl

NAIVE = PruningControl(budget="entropy", keep_min=0.05, min_blocks=2, entropy_low=0.5, entropy_high=3.0,
                       max_step=1.0)
GUARDS = {"entropy_min": 1.75, "min_blocks": 8}
HELD_OUT_OFFSET = 350_000  # characters into pydoc_data.topics (433K); the fidelity tests read 0-12K and 200K-212K


def held_out_text(tokens: int) -> str:
    import pydoc_data.topics

    text = re.sub(r"\s+", " ", " ".join(pydoc_data.topics.topics.values()))
    return text[HELD_OUT_OFFSET: HELD_OUT_OFFSET + tokens * 4]


def fit_calibrations(model_dir: str, scales: list[float], tokens: int) -> dict[float, dict[str, float]]:
    """Per scale: the fitted T_cal and the held-out NLL before and after calibration."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(held_out_text(tokens), return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    targets = ids[0, 1:]
    target_logits = logits.gather(1, targets[:, None])[:, 0]
    out = {}
    for s in scales:
        def nll(t: float, s: float = s) -> float:
            return float((torch.logsumexp(logits * (s / t), -1) - target_logits * (s / t)).mean())
        t_cal = fit_temperature(nll)
        out[s] = {"t_cal": t_cal, "nll": nll(1.0), "nll_calibrated": nll(t_cal), "positions": int(targets.numel())}
    return out


def _core(model: str):
    """The replica that serves (``workers.core.ReplicaCore``) with the logit-scaling instrument in front
    of our processor, so every layer reads the scaled logits."""
    from workers.engine import configure_process_env

    configure_process_env(2, 4)  # before vLLM is imported (workers.sampling imports it)
    from prometheus_client import CollectorRegistry

    from controller.config import SchedulingConfig
    from loadtest.instruments import LogitScale
    from workers.config import EngineConfig, ReplicaConfig
    from workers.core import ReplicaCore
    from workers.sampling import EntropicLogitsProcessor

    config = ReplicaConfig(model=model, engine=EngineConfig(max_model_len=8192, max_num_seqs=4, dtype="float32",
                                                            cpu_threads=2, kv_cache_space_gib=4),
                           scheduling=SchedulingConfig(enabled=False))
    return ReplicaCore(config, replica_id="calibration", metrics_registry=CollectorRegistry(),
                       logits_processors=[LogitScale, EntropicLogitsProcessor])


async def _run(core, prompts: list[str], keys: list[int], scale: float, pruning: PruningControl | None, t_cal: float,
               max_tokens: int) -> dict[str, float]:
    """The passkey prompts at once, greedy, through ``ReplicaCore.generate``."""
    from deployments.protocol import EntropicCompletionRequest
    from workers.pruning_state import STATE

    overrides = {"t_cal": t_cal, "pruning": pruning.model_dump() if pruning is not None else {"enabled": False}}
    texts: list[str] = []
    entropies: list[float] = []
    kept, total = STATE.stats.blocks_kept, STATE.stats.blocks_total

    async def one(prompt: str) -> None:
        request = EntropicCompletionRequest(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                            vllm_xargs={"fidelity_scale": scale})
        text = ""
        async for delta in core.generate("completion", request, overrides):
            text += delta.text
            entropies.extend(h for h in delta.entropy if math.isfinite(h))
        texts.append(text)

    for prompt in prompts:
        await one(prompt)  # one at a time: texts stay in prompt order
    total = STATE.stats.blocks_total - total
    return {"passkey": st.mean(str(k) in t for t, k in zip(texts, keys)),
            "kept": (STATE.stats.blocks_kept - kept) / total if total else 1.0,
            "entropy_mean": st.mean(entropies), "entropy_std": st.pstdev(entropies)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.5, 1.0, 4.0])
    parser.add_argument("--fit-tokens", type=int, default=1024, help="held-out tokens for the T_cal fit")
    parser.add_argument("--reps", type=int, nargs="+", default=[170, 295], help="filler repeats (~4K, ~7K tokens)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.2, 0.5, 0.8])
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--model", default="default", help="\"default\" or a local HF model directory")
    parser.add_argument("--out", default="docs/results/calibration")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    from loadtest.machine import cpu_text, publish
    from workers.model_store import resolve_model

    model_dir = str(resolve_model(args.model))
    fits = fit_calibrations(model_dir, args.scales, args.fit_tokens)
    core = _core(args.model)
    cases = [(reps, depth) for reps in args.reps for depth in args.depths]
    keys = [10007 + 7919 * i for i in range(len(cases))]
    prompts = [passkey_prompt(reps, depth, key) for (reps, depth), key in zip(cases, keys)]
    prompt_tokens = [len(core.runner.tokenizer.encode(p)) for p in prompts]

    guarded = NAIVE.merged(GUARDS)
    conditions = [("dense", None, False), ("no guard", NAIVE, False), ("guards", guarded, False),
                  ("T_cal", NAIVE, True), ("T_cal + guards", guarded, True)]
    rows = []

    async def runs() -> None:
        core.start()
        await _run(core, prompts, keys, 1.0, None, 1.0, 1)  # warm the prefix cache once for every run below
        with tqdm(total=len(args.scales) * len(conditions), desc="calibration stress") as bar:
            for s in args.scales:
                for name, pruning, calibrated in conditions:
                    t_cal = fits[s]["t_cal"] if calibrated else 1.0
                    rows.append({"scale": s, "condition": name, "t_cal": t_cal,
                                 **await _run(core, prompts, keys, s, pruning, t_cal, args.max_tokens)})
                    bar.update()

    asyncio.run(runs())

    def render(result: dict) -> str:
        m, n = result["machine"], result["naive"]
        lines = ["# Calibration stress (paper §6.2), measured", "", f"Command: `{result['command']}` (run {result['date']})",
                 "", f"Machine: {cpu_text(m)}, {m['cores']} cores; torch {m['torch']}, vllm {m['vllm']}.", "",
                 f"Passkeys: {len(result['prompt_tokens'])} prompts of {min(result['prompt_tokens'])}-"
                 f"{max(result['prompt_tokens'])} tokens, greedy, {result['max_tokens']} new tokens. Pruning law without "
                 f"guards: keep_min {n['keep_min']}, B_min {n['min_blocks']}, keep fraction from entropy "
                 f"{n['entropy_low']}-{n['entropy_high']} nats, no entropy floor; guards: H_min "
                 f"{result['guards']['entropy_min']}, B_min {result['guards']['min_blocks']}.", "",
                 "T_cal fitted on held-out text (NLL-minimising temperature of the scaled logits):", "",
                 "| logit scale | T_cal | held-out NLL at T=1 | NLL at T_cal | positions |", "|---|---|---|---|---|"]
        for s, f in result["fits"].items():
            lines.append(f"| {s} | {f['t_cal']:.3f} | {f['nll']:.3f} | {f['nll_calibrated']:.3f} | {f['positions']} |")
        lines += ["", "| logit scale | condition | T_cal | passkey accuracy | KV blocks attended | entropy mean "
                  "| entropy std |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            lines.append(f"| {r['scale']} | {r['condition']} | {r['t_cal']:.2f} | {r['passkey']:.2f} | {r['kept']:.2f} | "
                         f"{r['entropy_mean']:.3f} | {r['entropy_std']:.3f} |")
        lines.append("")
        return "\n".join(lines)

    publish("loadtest.calibration_stress", argv, args.out,
            {"fits": {str(s): f for s, f in fits.items()}, "rows": rows, "prompt_tokens": prompt_tokens,
             "max_tokens": args.max_tokens, "naive": NAIVE.model_dump(), "guards": GUARDS}, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
