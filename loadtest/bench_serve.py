"""Our server against `vllm serve`, both driven by vLLM's own client (`vllm bench serve`).

    make bench-serve ARGS="--pairs defaults matched --rounds 2"   (writes docs/results/serve.{md,json})

Each round starts one server, drives it with ``vllm bench serve`` over every data set, stops it, then
does the same with the other (the order alternates between rounds), so both see the same machine
in the same minutes: this machine's speed moves by up to 1.7x within minutes, and only ratios taken
within a round mean anything. The servers never run at the same time.

Pairs (``--pairs``):
- ``defaults``: ``python -m deployments.server`` as ``make serve`` starts it, against
  ``vllm serve MODEL`` as a user would start it (vLLM's defaults; our plugin kept out with
  ``VLLM_PLUGINS=``). What a user compares. Where vLLM's defaults do not start on the machine (on CPU they
  reserve 92% of the first NUMA node's memory), ``--vllm-args`` adds what its error message asks for; the
  result's server lines show it.
- ``matched``: the same dtype, compile mode (compiled), context length and batch size on both sides
  (our ``engine`` config is set to what vLLM is given). What our serving path and control layers cost
  or gain when nothing else differs.
- ``layers-off``: ``matched`` with our server's ``telemetry: false`` (no logits processor of ours, no π
  scheduler, no pruning; the engine's other settings, its CPU sampler among them, as in ``matched``).
  Against ``matched`` it splits what our serving path costs (Serve's proxy, the ingress, the replica and
  its engine process) from what the control layers cost.
- ``same-block``: ``matched`` with ``vllm serve`` given our KV block size (with pruning on, our CPU
  engine uses smaller blocks than vLLM's CPU default). Against ``matched`` it splits what the block
  size costs from what our serving path and layers cost.
- ``unpinned``: ``matched`` with ``engine.pin_cores: false`` (our engine process floats over every core,
  as before it took a core of its own). Against ``matched`` it shows what pinning gives.
- ``serve-stock`` and ``serve-throughput``: ``defaults`` with our server on Serve's data plane as Ray ships
  it (``RAY_SERVE_THROUGHPUT_OPTIMIZED=0``) and in Ray's throughput mode (``=1``; deployments/serve_env.py),
  each set explicitly, so they mean the same whatever ``make serve``'s default is. Against ``defaults`` or
  each other in the same run they show what the mode gives.

- ``--variant NAME=JSON`` (repeatable): a pair named NAME, ``matched`` with these fields of our AppConfig
  merged into our server's (e.g. ``no-borrow='{"engine": {"borrow_serving_cores": false}}'``): a setting of
  ours against another in the same rounds, without a scratch script. With ``--variant-base defaults``, built on
  ``defaults`` instead: a setting of ours against ``make serve`` as shipped and ``vllm serve``'s defaults.
  ``--variant-env NAME=KEY=VALUE`` (repeatable) gives our server in variant NAME one more environment variable
  (e.g. ``huge-pages='{}'`` with ``huge-pages=THP_MEM_ALLOC_ENABLE=1``): a setting that only the
  environment reaches, against the base pair's server in the same rounds.

Where two pairs of a run use the same ``vllm serve`` (the same command and environment: ``defaults``,
``serve-stock``, ``serve-throughput``; ``matched``, ``layers-off``, ``unpinned``; every variant with its base), it runs
once per round and its cells stand for each of those pairs, and the report also gives our server in the
later pair against ours in the earlier one, round by round: two settings of ours compared directly.

Data sets (``--sets``), all but ``natural-eos`` ``--ignore-eos`` to a fixed output length: a decode-speed
measurement, the same number of tokens on both sides (``vllm bench serve`` random data has no natural end
anyway):
- ``short``: random tokens, 256 in / 128 out, 48 requests at concurrency 16.
- ``long``: random tokens, 3900 in / 128 out, 16 requests at concurrency 8. Mostly prefill: each
  request's 128 tokens share their steps with the next requests' 2048-token prefill chunks.
- ``long-decode``: random tokens, 3900 in / 512 out, 8 requests at concurrency 8: all prompts arrive
  together, so after their prefill the steps only decode, at long context, where pruning acts.
- ``burst``: ``vllm bench serve``'s own defaults (random tokens, 1024 in / 128 out, every request sent at once,
  no ``--max-concurrency``) at 256 requests instead of its 1000, so that a round takes minutes, not an hour,
  on a 2-core CPU: what a user who runs the client without options sees, admission and queueing included.
  Not in the default ``--sets``.
- ``short-burst``: the same with ``short``'s 256-token prompts: decode outweighs prefill, so the batch size
  (``max_num_seqs``) decides the throughput. Not in the default ``--sets``.
- ``single``: random tokens, 256 in / 128 out, 16 requests one at a time (concurrency 1): the latency of
  one user on an idle server, where no batch hides a fixed cost per request or per token (the serving
  path's hops, a control layer's work per step). Not in the default ``--sets``.
- ``single-long``: the same at 3900 in, 6 requests: one long prompt's prefill, then decode at batch 1,
  where a step reads the model's weights and one request's KV cache. Not in the default ``--sets``.
- ``natural``: ~3900 tokens of English prose (Python's own documentation, ``pydoc_data``, shipped with
  every Python) then an instruction, 128 out, 16 requests at concurrency 8: the pruning law sees the
  entropy of real text instead of random tokens.
- ``natural-eos``: the same prose in the model's chat template, each output ending where the model ends
  it (at most 512 tokens): what a user's requests do. The servers may write different amounts, so the
  report gives each one's mean output length and how many outputs reached the limit, and requests per
  second beside tokens per second.

Sampling is each server's default for a request that names no temperature (``vllm bench serve`` no
longer sends one): vLLM's generation defaults there, ours with the entropy temperature law on.
``--client-args`` adds ``vllm bench serve``'s sampling options to every request, e.g. ``'--top-p 0.9'``:
what a client sets, or a model's generation config sets by default.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics as st
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The metrics every cell reports (vllm bench serve's result keys); higher is better only for throughputs.
METRICS = ("output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
           "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms")
# The metrics the report gives as ratios, in its column order, with their column names
RATIO_NAMES = {"output_throughput": "output tok/s", "mean_ttft_ms": "mean TTFT", "mean_tpot_ms": "mean TPOT",
               "p99_itl_ms": "p99 ITL"}
RATIO_METRICS = tuple(RATIO_NAMES)


@dataclass(frozen=True)
class DataSet:
    name: str
    args: tuple[str, ...]
    num_prompts: int
    concurrency: int | None  # None: every request sent at once, as vllm bench serve does unless told otherwise
    # vllm bench serve draws random prompts from its seed alone: two sets of one seed begin with the same
    # tokens, and the second set driven on a server would be served from the first's prefix cache
    seed: int
    # False: each output ends at the model's end of sequence (its output length an upper bound only), so
    # the two servers may write different amounts for the same prompts
    ignore_eos: bool = True

    @property
    def output_len(self) -> str:
        """The output length its ``vllm bench serve`` arguments ask for."""
        return next(self.args[i + 1] for i, a in enumerate(self.args) if a.endswith("-output-len"))


SETS = {
    "short": DataSet("short", ("--dataset-name", "random", "--random-input-len", "256",
                               "--random-output-len", "128"), 48, 16, 0),
    "long": DataSet("long", ("--dataset-name", "random", "--random-input-len", "3900",
                             "--random-output-len", "128"), 16, 8, 1),
    "long-decode": DataSet("long-decode", ("--dataset-name", "random", "--random-input-len", "3900",
                                           "--random-output-len", "512"), 8, 8, 2),
    "burst": DataSet("burst", ("--dataset-name", "random", "--random-input-len", "1024",
                               "--random-output-len", "128"), 256, None, 5),
    "short-burst": DataSet("short-burst", ("--dataset-name", "random", "--random-input-len", "256",
                                           "--random-output-len", "128"), 256, None, 6),
    "single": DataSet("single", ("--dataset-name", "random", "--random-input-len", "256",
                                 "--random-output-len", "128"), 16, 1, 7),
    "single-long": DataSet("single-long", ("--dataset-name", "random", "--random-input-len", "3900",
                                           "--random-output-len", "128"), 6, 1, 8),
    "natural": DataSet("natural", ("--dataset-name", "custom", "--custom-output-len", "128",
                                   "--skip-chat-template"), 16, 8, 3),
    "natural-eos": DataSet("natural-eos", ("--dataset-name", "custom", "--custom-output-len", "512"), 16, 8, 4,
                           ignore_eos=False),
}
NATURAL_SETS = ("natural", "natural-eos")
# run when named: the bursts take minutes per server and round, the single-request sets ask another question
NAMED_ONLY_SETS = ("burst", "short-burst", "single", "single-long")
NATURAL_TOKENS = 3900
KV_CACHE_GIB = 2  # matched pair: both servers' KV cache (ours: engine.kv_cache_space_gib's default)
NATURAL_INSTRUCTION = "\n\nSummarize the documentation above in one paragraph."


@dataclass
class Server:
    """One way of serving the model: a command line, its environment, and the port it answers on."""
    label: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    config: dict | None = None  # our AppConfig fields, written to a file passed with --config

    @property
    def command(self) -> str:
        """What makes two servers the same one to run: command line, environment and config."""
        return json.dumps([self.argv, self.env, self.config])

    def start(self, workdir: Path, log: Path) -> tuple[subprocess.Popen, float]:
        argv = list(self.argv)
        if self.config is not None:
            path = workdir / f"{self.label}.json"
            path.write_text(json.dumps(self.config))
            argv += ["--config", str(path)]
        if _answers(self.port):  # a server still shutting down there would be measured instead of this one
            raise RuntimeError(f"port {self.port} still answers before {self.label} starts")
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, env={**os.environ, **self.env}, stdout=log.open("ab"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{self.port}"
        while time.monotonic() - t0 < 1200:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {proc.returncode} while starting; see {log}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:  # both: 200 once engines serve
                    if resp.status == 200:
                        return proc, time.monotonic() - t0
            except OSError:
                pass
            time.sleep(2)
        stop(proc, self.port)
        raise RuntimeError(f"{self.label} not ready after 1200 s; see {log}")


def _answers(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop(proc: subprocess.Popen, port: int) -> None:
    """Ctrl-C to the server's whole process group (both servers shut down cleanly on it), then kill; then
    wait until nothing answers on its port (Ray's proxy can outlive the process that started it)."""
    for sig, wait in ((signal.SIGINT, 90), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + 180
    while _answers(port):
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} still answers 180 s after its server was stopped")
        time.sleep(2)


def natural_dataset(path: Path, model_dir: str, n: int, tokens: int = NATURAL_TOKENS) -> None:
    """``n`` windows of ``tokens`` tokens of Python's documentation, each a different stretch."""
    import pydoc_data.topics as topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stride = max(tokens, (len(ids) - tokens) // max(1, n - 1))
    with path.open("w") as f:
        for i in range(n):
            start = min(i * stride, len(ids) - tokens)
            prompt = tok.decode(ids[start:start + tokens]) + NATURAL_INSTRUCTION
            f.write(json.dumps({"prompt": prompt}) + "\n")


def drive(server: Server, data: DataSet, model_name: str, model_dir: str, workdir: Path, tag: str,
          natural: Path, client_args: Sequence[str] = ()) -> dict:
    out = workdir / f"{tag}.json"
    argv = [sys.executable, "-m", "loadtest.vllm_cli", "bench", "serve", "--backend", "openai",
            "--base-url", f"http://127.0.0.1:{server.port}", "--model", model_name, "--tokenizer", model_dir,
            *data.args, "--num-prompts", str(data.num_prompts),
            *(("--max-concurrency", str(data.concurrency)) if data.concurrency is not None else ()),
            # per request: each gap between tokens (itl_shape) and, where outputs end at EOS, its length
            *(("--ignore-eos",) if data.ignore_eos else ()), "--save-detailed", "--num-warmups", "2",
            "--seed", str(data.seed), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(workdir), "--result-filename", out.name, *client_args]
    if data.name in NATURAL_SETS:
        argv += ["--dataset-path", str(natural)]
    with (workdir / "client.log").open("ab") as log:
        subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=1800,
                       env={**os.environ, "VLLM_PLUGINS": ""})
    result = json.loads(out.read_text())
    cell = {m: result.get(m) for m in METRICS}
    cell.update(completed=result.get("completed"), failed=result.get("failed", 0),
                total_output_tokens=result.get("total_output_tokens"))
    if not data.ignore_eos:
        cell.update(output_lengths(result.get("output_lens", []), int(data.output_len)))
    cell.update(itl_shape(result.get("itls") or []))
    return cell


def itl_shape(itls: Sequence[Sequence[float]]) -> dict:
    """How evenly each stream's tokens arrive, from every gap between two tokens of one request: the share
    under half the median gap (a token that came right behind a late one: delivery bunched them) and the
    share over twice it (a step shared with other requests' prefill, or a late delivery)."""
    gaps = [g for request in itls for g in request]
    if not gaps:
        return {}
    median = st.median(gaps)
    return {"itl_under_half_median": sum(g < median / 2 for g in gaps) / len(gaps),
            "itl_over_twice_median": sum(g > 2 * median for g in gaps) / len(gaps)}


def output_lengths(lens: Sequence[int], limit: int) -> dict:
    """What a set whose outputs end at EOS wrote: mean tokens per output, and how many outputs the length
    limit cut (failed requests report 0 tokens and are left out)."""
    done = [n for n in lens if n > 0]
    return {"mean_output_len": st.mean(done) if done else None, "outputs_at_limit": sum(n >= limit for n in done)}


PAIRS = ("defaults", "matched", "layers-off", "same-block", "unpinned", "serve-stock", "serve-throughput")


def pair_servers(pair: str, model_dir: str, model_name: str, dtype: str,
                 vllm_args: Sequence[str] = ()) -> tuple[Server, Server]:
    ours_argv = [sys.executable, "-m", "deployments.server", "--port", "8100"]
    vllm_argv = [sys.executable, "-m", "loadtest.vllm_cli", "serve", model_dir, "--port", "8200",
                 "--served-model-name", model_name, *vllm_args]
    plain = {"VLLM_PLUGINS": ""}  # a user's vLLM has no plugin of ours
    if pair in ("defaults", "serve-stock", "serve-throughput"):
        from deployments.serve_env import THROUGHPUT_SWITCH

        switch = {"serve-stock": {THROUGHPUT_SWITCH: "0"}, "serve-throughput": {THROUGHPUT_SWITCH: "1"}}
        return Server("ours", ours_argv, 8100, env=switch.get(pair, {})), Server("vllm", vllm_argv, 8200, env=plain)
    if pair in ("matched", "layers-off", "same-block", "unpinned"):
        engine = {"enforce_eager": False, "dtype": dtype, "max_model_len": 8192, "max_num_seqs": 16,
                  "kv_cache_space_gib": KV_CACHE_GIB, **({"pin_cores": False} if pair == "unpinned" else {})}
        vllm_argv += ["--dtype", dtype, "--max-model-len", "8192", "--max-num-seqs", "16"]
        if pair == "same-block":
            from workers.config import CPU_PRUNING_BLOCK_SIZE

            vllm_argv += ["--block-size", str(CPU_PRUNING_BLOCK_SIZE)]
        # vLLM on CPU otherwise sizes its KV cache to 90% of memory, which at float32 exhausted 24 GiB here
        config: dict = {"engine": engine, **({"telemetry": False} if pair == "layers-off" else {})}
        return (Server("ours", ours_argv, 8100, config=config),
                Server("vllm", vllm_argv, 8200, env={**plain, "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}))
    raise ValueError(pair)


def variant_servers(pair: str, variants: dict[str, dict], model_dir: str, model_name: str, dtype: str,
                    vllm_args: Sequence[str] = (), base: str = "matched") -> tuple[Server, Server]:
    """``pair_servers``, where a pair named in ``variants`` is ``base`` with those AppConfig fields merged
    into our server's."""
    if pair not in variants:
        return pair_servers(pair, model_dir, model_name, dtype, vllm_args)
    ours, theirs = pair_servers(base, model_dir, model_name, dtype, vllm_args)
    ours.config = merged(ours.config or {}, variants[pair])
    return ours, theirs


def parse_variant_env(text: str) -> tuple[str, str, str]:
    """``NAME=KEY=VALUE`` (``--variant-env``) as the variant's name and one environment variable."""
    name, _, rest = text.partition("=")
    key, sep, value = rest.partition("=")
    if not sep or not name or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=KEY=VALUE")
    return name, key, value


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME=JSON`` (``--variant``) as the pair's name and its AppConfig fields."""
    name, sep, fields = text.partition("=")
    if not sep or not name or name in PAIRS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=JSON with a NAME that is not one of {PAIRS}")
    try:
        config = json.loads(fields)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{name}: {exc}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{name}: the fields must be a JSON object, got {fields!r}")
    return name, config


def merged(base: dict, extra: dict) -> dict:
    """``base`` with ``extra``'s fields, nested sections (``engine``) merged field by field."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def summarize(cells: list[dict]) -> dict:
    """Per metric and data set: each round's ours/vllm ratio, their median and range."""
    out: dict = {}
    for pair in sorted({c["pair"] for c in cells}):
        for data in sorted({c["set"] for c in cells if c["pair"] == pair}):
            rows = [c for c in cells if c["pair"] == pair and c["set"] == data]
            rounds = sorted({c["round"] for c in rows})
            entry: dict = {}
            for metric in METRICS:
                ratios = []
                for r in rounds:
                    by = {c["server"]: c for c in rows if c["round"] == r}
                    ours, theirs = by.get("ours", {}).get(metric), by.get("vllm", {}).get(metric)
                    if ours and theirs:
                        ratios.append(ours / theirs)
                entry[metric] = {
                    "ours": [c[metric] for c in rows if c["server"] == "ours"],
                    "vllm": [c[metric] for c in rows if c["server"] == "vllm"],
                    "ratios": ratios,
                    "median_ratio": st.median(ratios) if ratios else None,
                }
            out[f"{pair}/{data}"] = entry
    return out


def between_pairs(result: dict) -> dict[str, dict[str, list[float]]]:
    """Our server in one pair against our server in an earlier pair of the same run whose ``vllm serve`` ran
    the same command: per data set and round, ours / ours, for ``RATIO_METRICS``.

    Both of ours ran in the same rounds, so their direct ratio is the comparison of two settings of ours
    (``serve-stock`` against ``defaults``, ``layers-off`` against ``matched``); the ratio of their two
    ratios to ``vllm serve`` would add that server's own spread.
    """
    pairs = list(dict.fromkeys(c["pair"] for c in result["cells"]))
    vllm_of = {p: result["servers"].get(f"{p}/vllm") for p in pairs}
    out: dict[str, dict[str, list[float]]] = {}
    for i, pair in enumerate(pairs):
        base = next((b for b in pairs[:i] if vllm_of[b] is not None and vllm_of[b] == vllm_of[pair]), None)
        if base is None:
            continue
        for data in dict.fromkeys(c["set"] for c in result["cells"] if c["pair"] == pair):
            ours = {(c["pair"], c["round"]): c for c in result["cells"]
                    if c["server"] == "ours" and c["set"] == data and c["pair"] in (pair, base)}
            rounds = sorted(r for p, r in ours if p == pair and (base, r) in ours)
            out[f"{pair}/{data} / {base}/{data}"] = {
                m: [ours[pair, r][m] / ours[base, r][m] for r in rounds if ours[pair, r].get(m) and
                    ours[base, r].get(m)] for m in RATIO_METRICS}
    return out


def outputs_text(sets: Sequence[str]) -> str:
    """How the outputs of a run's sets end, for the report's preamble."""
    fixed = [f"{SETS[n].output_len} tokens in `{n}`" for n in sets if SETS[n].ignore_eos]
    ended = [f"at most {SETS[n].output_len} tokens in `{n}`" for n in sets if not SETS[n].ignore_eos]
    parts = []
    if fixed:
        parts.append(("Outputs" if ended else "All outputs")
                     + f" `--ignore-eos` to a fixed length (decode-speed measurement): {', '.join(fixed)}.")
    if ended:
        parts.append(f"Outputs ending at the model's end of sequence: {', '.join(ended)}.")
    return " ".join(parts)


def render(result: dict) -> str:
    from loadtest.machine import cpu_text

    lines = ["# Our server vs `vllm serve`, driven by `vllm bench serve`", "",
             f"Command: `{result['command']}`  ", f"Date: {result['date']}  ",
             f"Machine: {cpu_text(result['machine'])}, {result['machine']['cores']} cores, "
             f"{result['machine']['memory_gib']} GiB; torch {result['machine']['torch']}, "
             f"vLLM {result['machine']['vllm']}; our dtype for `auto`: {result['machine']['cpu_dtype_auto']}", "",
             "Each cell: ours / vllm per round (servers alternate, one at a time), median [min-max] over "
             f"{result['rounds']} rounds. Throughput: higher is better for us above 1; times: lower is better "
             "for us below 1. " + outputs_text(list(dict.fromkeys(c["set"] for c in result["cells"])))
             + (f" Every request with `{' '.join(result['client_args'])}` (`vllm bench serve`'s options)."
                if result.get("client_args") else ""), "",
             "| pair / set | " + " | ".join(RATIO_NAMES[m] for m in RATIO_METRICS) + " | ours tok/s | vllm tok/s |",
             "|---|---|---|---|---|---|---|"]
    for key, entry in result["summary"].items():
        def cell(metric: str, entry: dict = entry) -> str:
            r = entry[metric]["ratios"]
            return f"{st.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]" if r else "n/a"

        tps = entry["output_throughput"]
        pair, data = key.split("/", 1)
        # a failed request's tokens count nowhere, so a ratio over runs that lost requests compares unequal work
        lost = {server: sum(c.get("failed") or 0 for c in result["cells"]
                            if c["pair"] == pair and c["set"] == data and c["server"] == server)
                for server in ("ours", "vllm")}
        label = key + (f" ({lost['ours']} of ours failed, {lost['vllm']} of vllm's; the ratios count completed "
                       "requests only)" if any(lost.values()) else "")
        lines.append(f"| {label} | " + " | ".join(cell(m) for m in RATIO_METRICS)
                     + f" | {', '.join(f'{v:.0f}' for v in tps['ours'])} | {', '.join(f'{v:.0f}' for v in tps['vllm'])} |")
    between = between_pairs(result)
    if between:
        lines += ["", "Our server against our server in an earlier pair that ran the same `vllm serve`, in the same "
                  "rounds (each round's ours / ours; above 1 the first named is faster for throughput, slower for "
                  "times):", ""]
        for key, ratios in between.items():
            lines.append(f"- {key}: " + "; ".join(
                f"{RATIO_NAMES[m]} " + ", ".join(f"{v:.2f}x" for v in ratios[m]) for m in RATIO_METRICS if ratios[m]))
    ended = [key for key in result["summary"] if not SETS[key.split("/", 1)[1]].ignore_eos]
    if ended:
        lines += ["", "Sets whose outputs end where the model ends them: per round, ours / vllm in requests per second; "
                  "each server's mean output length in tokens and its outputs cut by the length limit (of the "
                  "requests run).", ""]
    for key in ended:
        pair, data = key.split("/", 1)
        rows = {s: [c for c in result["cells"] if c["pair"] == pair and c["set"] == data and c["server"] == s]
                for s in ("ours", "vllm")}
        lines.append(f"- {key}: requests/s " + ", ".join(
            f"{v:.2f}x" for v in result["summary"][key]["request_throughput"]["ratios"]) + "; " + "; ".join(
            f"{s} " + ", ".join(f"{c['mean_output_len']:.0f} tokens ({c['outputs_at_limit']} of {c['completed']} "
                                 "at the limit)" for c in cs if c.get("mean_output_len") is not None)
            for s, cs in rows.items()))
    lines += ["", "Per server, ms (each round): mean TPOT and median ITL. The median gap between tokens is a step "
              "that only decodes; where TPOT is far above it, most of a token's time is spent in steps shared with "
              "other requests' prefill, which decode speed does not shorten. Where measured, the share of gaps "
              "under half the median (tokens delivered bunched behind a late one) and over twice it.", ""]
    for key, entry in result["summary"].items():
        pair, data = key.split("/", 1)
        for server in ("ours", "vllm"):
            tpot, itl = entry["mean_tpot_ms"][server], entry.get("median_itl_ms", {}).get(server, [])
            if tpot and all(v is not None for v in itl):
                shapes = [c for c in result["cells"] if c["pair"] == pair and c["set"] == data
                          and c["server"] == server and "itl_under_half_median" in c]
                lines.append(f"- {key} {server}: TPOT " + ", ".join(f"{v:.0f}" for v in tpot)
                             + ("; median ITL " + ", ".join(f"{v:.0f}" for v in itl) if itl else "")
                             + ("; gaps under half the median " + ", ".join(
                                 f"{100 * c['itl_under_half_median']:.1f}%" for c in shapes) + ", over twice it "
                                + ", ".join(f"{100 * c['itl_over_twice_median']:.1f}%" for c in shapes)
                                if shapes else ""))
    if result["startup_s"]:
        lines += ["", "Start-up to the first 200 from `/health`, seconds (per round):", ""]
    for key, starts in result["startup_s"].items():
        lines.append(f"- {key}: " + ", ".join(f"{s:.0f}" for s in starts))
    for note in result.get("excluded", []):
        lines += ["", f"Excluded: {note}"]
    shared = sorted({(c["pair"], c["measured_in"]) for c in result["cells"] if c.get("measured_in")})
    if shared:
        lines += ["", "`vllm serve` ran once per round for pairs that give it the same command and environment: "
                  + "; ".join(f"{p}'s are {first}'s runs" for p, first in shared) + "."]
    failed = [c for c in result["cells"] if c.get("failed") and not c.get("measured_in")]
    lines += ["", f"Failed requests: {sum(c['failed'] for c in failed)}"
              + (" (" + ", ".join(f"{c['pair']}/{c['set']}/{c['server']} round {c['round']}: {c['failed']}"
                                  for c in failed) + ")" if failed else ""), "",
              "Servers: " + "; ".join(f"{k}: `{' '.join(v)}`" for k, v in result["servers"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["defaults", "matched"], choices=PAIRS)
    parser.add_argument("--variant", action="append", type=parse_variant, default=[], metavar="NAME=JSON",
                        help="one more pair, NAME: --variant-base's pair with these AppConfig fields of our server "
                        "merged in (repeatable); runs after --pairs, against the same vllm serve as that pair")
    parser.add_argument("--variant-base", choices=("matched", "defaults"), default="matched",
                        help="the pair every --variant is built on")
    parser.add_argument("--variant-env", action="append", type=parse_variant_env, default=[],
                        metavar="NAME=KEY=VALUE", help="one more environment variable for our server in the "
                        "--variant NAME (repeatable)")
    parser.add_argument("--sets", nargs="+", default=[s for s in SETS if s not in NAMED_ONLY_SETS], choices=list(SETS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="docs/results/serve")
    parser.add_argument("--vllm-args", default="", help="more arguments for `vllm serve` in every pair, as one "
                        "string: what a user must add where vLLM's defaults do not start (e.g. "
                        "'--gpu-memory-utilization 0.5' where the CPU's NUMA node has less memory than vLLM's "
                        "default fraction asks for)")
    parser.add_argument("--ours-config", type=json.loads, default={}, help="our AppConfig fields for our server "
                        "in every pair, as JSON, merged into the pair's (e.g. '{\"engine\": {\"borrow_min_context\": "
                        "12288}}'): a setting of ours against the same `vllm serve`")
    parser.add_argument("--client-args", default="", help="more arguments for `vllm bench serve`, as one string: "
                        "its sampling options for every request (e.g. '--top-p 0.9')")
    parser.add_argument("--ours-env", nargs="+", default=[], metavar="NAME=VALUE", help="environment variables for "
                        "our server in every pair (e.g. RAY_SERVE_THROUGHPUT_OPTIMIZED=1: Ray's throughput mode, "
                        "deployments/serve_env.py)")
    args = parser.parse_args(argv)
    ours_env = dict(item.split("=", 1) for item in args.ours_env)
    variants = dict(args.variant)
    variant_env: dict[str, dict[str, str]] = {}
    for name, key, value in args.variant_env:
        if name not in variants:
            parser.error(f"--variant-env {name}={key}=...: no --variant {name}")
        variant_env.setdefault(name, {})[key] = value
    client_args = shlex.split(args.client_args)

    from kernels.hardware import resolve_dtype
    from loadtest.machine import publish
    from workers.model_store import DEFAULT_MODEL, DEFAULT_MODEL_NAME, resolve_model

    model_dir = str(resolve_model(DEFAULT_MODEL))
    dtype = resolve_dtype("auto", False)
    workdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    natural = workdir / "natural.jsonl"
    if set(NATURAL_SETS) & set(args.sets):
        natural_dataset(natural, model_dir, max(SETS[s].num_prompts for s in NATURAL_SETS) + 2)  # + 2 warm-ups
    print(f"logs and raw results: {workdir}", flush=True)
    pairs = list(dict.fromkeys([*args.pairs, *variants]))
    cells: list[dict] = []
    startup: dict[str, list[float]] = {}
    servers_seen: dict[str, list[str]] = {}
    for r in range(args.rounds):
        ran: dict[str, tuple[str, list[dict]]] = {}  # this round's vllm serve runs: command -> (pair, cells)
        for pair in pairs:
            ours, theirs = variant_servers(pair, variants, model_dir, DEFAULT_MODEL_NAME, dtype,
                                           shlex.split(args.vllm_args), args.variant_base)
            if args.ours_config:
                ours.config = merged(ours.config or {}, args.ours_config)
            ours.env.update({**ours_env, **variant_env.get(pair, {})})
            for server in ((theirs, ours) if r % 2 == 0 else (ours, theirs)):
                key = f"{pair}/{server.label}"
                servers_seen[key] = ([f"{k}={v}" for k, v in server.env.items()] if server is ours else []) + \
                    server.argv + ([f"(config {json.dumps(server.config)})"] if server.config else [])
                command = server.command
                if server is theirs and command in ran:  # the same vllm serve already ran this round
                    first, measured = ran[command]
                    cells += [{**c, "pair": pair, "measured_in": first} for c in measured]
                    continue
                proc, started = server.start(workdir, workdir / f"{pair}-{server.label}-{r}.log")
                startup.setdefault(key, []).append(started)
                measured = []
                try:
                    for name in args.sets:
                        cell = drive(server, SETS[name], DEFAULT_MODEL_NAME, model_dir, workdir,
                                     f"{pair}-{name}-{server.label}-{r}", natural, client_args)
                        cell.update(pair=pair, set=name, server=server.label, round=r)
                        measured.append(cell)
                        print(json.dumps(cell), flush=True)
                finally:
                    stop(proc, server.port)
                cells += measured
                if server is theirs:
                    ran[command] = (pair, measured)
    publish("loadtest.bench_serve", argv, args.out,
            {"rounds": args.rounds, "client_args": client_args, "cells": cells, "startup_s": startup,
             "servers": servers_seen,
             "summary": summarize(cells)}, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
