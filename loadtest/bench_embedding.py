"""What running the engine in the replica's process costs or saves against vLLM's multiprocess engine core.

    make bench-embedding ARGS="--rounds 2"      (writes docs/results/engine-embedding.{md,json})

A replica runs vLLM's ``LLMEngine`` in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
control layers read telemetry off the logits processor between steps (docs/design/engine-embedding.md).
The alternative is vLLM's default: the engine core (scheduler, model, logits processors) in a
background process, the front end (detokenization, output handling) in the caller's, talking over
ZeroMQ. This runs the same batch through both, each in a fresh process, alternating, plain vLLM in
both (no plugin of ours, no logits processor): offline ``LLM.generate`` of ``--batch`` chat prompts,
``--max-tokens`` each with ignore_eos (a decode-speed measurement), plus single-request latency.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics as st
import subprocess
import sys
import time

_RESULT = "bench_embedding result: "
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how photosynthesis works.",
           "Describe the city of Paris to a tourist.", "Write a poem about the ocean."]


def worker(args) -> dict:
    from workers.engine import configure_process_env

    configure_process_env(args.threads, 2)
    # configure_process_env pins the in-process engine; the other arm asks for vLLM's default
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.worker == "multiprocess" else "0"
    from vllm import LLM, SamplingParams

    from workers.model_store import resolve_model

    llm = LLM(model=str(resolve_model(args.model)), enforce_eager=True, dtype="float32", max_model_len=2048,
              max_num_seqs=args.batch, seed=0)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                             add_generation_prompt=True, tokenize=False) for i in range(args.batch)]
    batch = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    single = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(prompts[:2], batch, use_tqdm=False)  # warm-up
    rates, singles = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, batch, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        llm.generate(prompts[:1], single, use_tqdm=False)
        singles.append(time.perf_counter() - t0)
    return {"tokens_per_s": st.median(rates), "rates": rates, "single_16_tokens_s": st.median(singles)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["in_process", "multiprocess"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", default="docs/results/engine-embedding")
    args = parser.parse_args(argv)
    if args.worker:
        print(_RESULT + json.dumps(worker(args)), flush=True)
        return 0

    from loadtest.machine import cpu_text, publish

    arms = ["in_process", "multiprocess"]
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms[r % 2:] + arms[:r % 2]:
            cmd = [sys.executable, "-m", "loadtest.bench_embedding", "--worker", arm, "--batch", str(args.batch),
                   "--max-tokens", str(args.max_tokens), "--reps", str(args.reps), "--threads", str(args.threads),
                   "--model", args.model]
            env = {**os.environ, "VLLM_PLUGINS": "none-of-ours"}
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{arm} failed:\n{out.stderr[-4000:]}")
            # the engine core process of the multiprocess arm logs to stdout too: find our line
            line = next(x for x in out.stdout.splitlines() if x.startswith(_RESULT))
            runs[arm].append(json.loads(line[len(_RESULT):]))
            print(f"round {r + 1} {arm}: {runs[arm][-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    summary = {a: {k: st.median(x[k] for x in runs[a]) for k in ("tokens_per_s", "single_16_tokens_s")} for a in arms}
    paired = [m["tokens_per_s"] / i["tokens_per_s"] for i, m in zip(runs["in_process"], runs["multiprocess"])]

    def render(result: dict) -> str:
        m, s = result["machine"], result["summary"]
        return "\n".join([
            "# Engine in the replica's process vs vLLM's multiprocess engine core", "",
            f"Command: `{result['command']}` (run {result['date']})", "",
            f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu']}; torch {m['torch']}, "
            f"vllm {m['vllm']}; {args.threads} engine threads, float32, plain vLLM in both (no plugin, no "
            "logits processor of ours).", "",
            f"Batch {args.batch} x {args.max_tokens} tokens (ignore_eos), {args.reps} repetitions per process, "
            f"{args.rounds} processes per arm, alternated.", "",
            "| engine | tokens/s (batch) | one request, 16 tokens (s) |", "|---|---|---|",
            *[f"| {a} | {s[a]['tokens_per_s']:.1f} | {s[a]['single_16_tokens_s']:.3f} |" for a in arms], "",
            "Multiprocess / in-process throughput per round: " + ", ".join(f"{x:.3f}" for x in result["paired"]), ""])

    publish("loadtest.bench_embedding", argv, args.out, {"summary": summary, "runs": runs, "paired": paired}, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
