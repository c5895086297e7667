"""Where the engine's time goes while each server is under `vllm bench serve` load (issue: speed vs vllm serve).

    make profile-serve ARGS="--rounds 2"   (writes docs/results/serve-profile.{md,json})

Each round starts our server and `vllm serve` (the ``matched`` pair of ``loadtest.bench_serve``: same
dtype, compiled, context, batch and KV cache), one at a time in alternating order, and drives each with
one data set while sampling, once a second. With ``--pairs matched layers-off`` a round also starts our
server with its control layers off (``layers-off``; `vllm serve` runs once a round, as the two pairs give
it the same settings): what the layers cost, function by function. Per server and round:

* the CPU time of the thread that runs the model: our replica's engine thread (named ``vllm-engine``, in
  the replica's engine process ``engine-<replica id>``, workers/process.py) or the main thread of vLLM's
  ``VLLM::Worker`` process; and of every other thread of that process;
* the machine's idle and steal time (``/proc/stat``).

The loaded window is from the first to the last second in which the model thread used more than half a
core. Over it the result gives the model thread's share of one core (1.0: it never waited), the rest of
its process's CPU, and the machine's idle share: a model thread well under 1.0 while the machine has
idle CPU is waiting inside its own process (on Python's GIL: until our replica moved its engine into a
process of its own, Ray Serve's request handling ran in the engine's process), not for a core.

With ``--pyspy-s N`` and ``py-spy`` on PATH (``pip install py-spy``; needs ptrace permission) it also samples
the model thread's native stacks for N seconds, from the tenth loaded second on, and counts the samples
waiting to take the GIL. A set that ends sooner leaves part of those seconds idle: ``--num-prompts`` sends
more of its requests (on a fast host the 48 of ``short`` take ~25 s).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics as st
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from loadtest.bench_serve import NATURAL_SETS, SETS, DataSet, Server, drive, natural_dataset, pair_servers, stop

PAIRS = ("matched", "layers-off")  # pairs whose `vllm serve` is the same, so one run of it serves them all
_BUSY = 0.5  # a second in which the model thread used more than this share of a core is "loaded"
_SPY_AFTER_LOADED_S = 10  # py-spy starts past the client's warm-up and the first admissions, into the steady run


def _ticks(path: str) -> int:
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _threads(pid: int) -> dict[int, tuple[str, int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = (Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip(),
                             _ticks(f"/proc/{pid}/task/{tid}/stat"))
        except OSError:
            continue
    return out


def process_role(comm: str, argv: list[str]) -> str:
    """What a process is, by its name: Ray's workers title themselves ``ray::<actor>`` (``.<method>`` while a
    method runs, dropped here), our engine process names itself ``engine-<replica id>``, vLLM's own processes
    ``VLLM::<what>``; anything else by its program and, for ``python -m``, its module and first argument."""
    if argv and argv[0].startswith("ray::"):
        return argv[0].split(".", 1)[0]
    if comm.startswith("engine-"):
        return "engine process"
    if argv and argv[0].startswith("VLLM::"):
        return argv[0].split()[0]
    if comm.startswith("VLLM::"):
        return comm
    if "-m" in argv[:-1]:
        i = argv.index("-m")
        return " ".join(["python -m", *argv[i + 1:i + 3]])
    return os.path.basename(argv[0]) if argv else comm


def _processes() -> dict[int, tuple[str, int]]:
    """Every process's role and CPU ticks (utime + stime)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
            out[int(entry)] = (process_role(comm, [a for a in argv if a]), _ticks(f"/proc/{entry}/stat"))
        except OSError:  # gone meanwhile
            continue
    return out


def _machine() -> tuple[int, int, int]:
    cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in cpu]
    return sum(values), values[3] + values[4], values[7] if len(values) > 7 else 0  # total, idle+iowait, steal


def model_process(label: str) -> int:
    """The pid of the process whose thread runs the model."""
    # Ours: the engine process names itself engine-<replica id> (its comm, which pgrep matches without -f)
    command = ["pgrep", "^engine-"] if label == "ours" else ["pgrep", "-f", "VLLM::Worker"]
    pattern = command[-1]
    found = subprocess.run(command, capture_output=True, text=True).stdout.split()
    if len(found) != 1:
        raise RuntimeError(f"expected one process matching {pattern!r}, found {found}")
    return int(found[0])


def model_thread(label: str, pid: int, threads: dict[int, tuple[str, int]]) -> int:
    if label == "ours":
        named = [tid for tid, (name, _) in threads.items() if name == "vllm-engine"]
        if not named:
            raise RuntimeError(f"no thread named vllm-engine in {pid}: {sorted(n for n, _ in threads.values())}")
        # A pinned engine that may borrow a core has an OpenMP worker thread too, which inherits the name of
        # the engine thread that created it: that one came second
        return min(named)
    return pid  # vLLM's worker runs the model on its main thread


class Sampler:
    """Per-second CPU samples of one process's threads and of the machine, on a background thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, dict[int, tuple[str, int]], tuple[int, int, int]]] = []
        # every process of the machine, sampled with ``samples`` (same index): where the serving path's CPU goes
        self.processes: list[dict[int, tuple[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            processes = _processes()
            self.samples.append((time.monotonic(), _threads(self.pid), _machine()))
            self.processes.append(processes)
            self._stop.wait(1.0)

    def model_shares(self, label: str) -> tuple[int, list[float]]:
        """The model thread's id and its share of a core in each second sampled so far."""
        hz = os.sysconf("SC_CLK_TCK")
        samples = list(self.samples)  # the sampling thread appends meanwhile
        tid = model_thread(label, self.pid, samples[-1][1])
        return tid, [(b.get(tid, ("", 0))[1] - a.get(tid, ("", 0))[1]) / hz / (t1 - t0)
                     for (t0, a, _), (t1, b, _) in zip(samples, samples[1:])]

    def wait_loaded(self, label: str, seconds: int, timeout_s: float = 600.0) -> bool:
        """Wait until the model thread has been loaded for ``seconds`` seconds; False after ``timeout_s`` or
        once sampling has stopped (the run ended first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if len(self.samples) > 1 and sum(s > _BUSY for s in self.model_shares(label)[1]) >= seconds:
                return True
            time.sleep(1.0)
        return False

    def summary(self, label: str) -> dict:
        hz = os.sysconf("SC_CLK_TCK")
        tid, per_s = self.model_shares(label)
        loaded = [i for i, share in enumerate(per_s) if share > _BUSY]
        if not loaded:
            raise RuntimeError(f"{label}: the model thread never used half a core")
        first, last = loaded[0], loaded[-1] + 1  # sample indices bounding the window
        (t0, a, m0), (t1, b, m1) = self.samples[first], self.samples[last]
        wall = t1 - t0

        def cpu(threads_after: dict, threads_before: dict, keep) -> float:
            return sum(ticks - threads_before.get(t, ("", 0))[1] for t, (_, ticks) in threads_after.items()
                       if keep(t)) / hz

        total = m1[0] - m0[0]
        by_role: dict[str, float] = {}
        if len(self.processes) > last:
            before, after = self.processes[first], self.processes[last]
            for pid, (role, ticks) in after.items():  # a process started in the window counts from 0
                by_role[role] = by_role.get(role, 0.0) + (ticks - before.get(pid, (role, 0))[1]) / hz / wall
        return {"window_s": round(wall, 1),
                "process_core_shares": {role: round(v, 3) for role, v in sorted(by_role.items(), key=lambda kv: -kv[1])
                                        if v >= 0.005},
                "model_thread_core_share": round(cpu(b, a, lambda t: t == tid) / wall, 3),
                "other_threads_core_share": round(cpu(b, a, lambda t: t != tid) / wall, 3),
                "machine_idle_share": round((m1[1] - m0[1]) / total, 3) if total else None,
                "machine_steal_share": round((m1[2] - m0[2]) / total, 3) if total else None}


def pyspy_path() -> str | None:
    """py-spy on PATH, or beside this Python (``make`` runs the venv's Python without its bin on PATH)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def gil_waits(pid: int, tid: int, seconds: int) -> dict | None:
    """The model thread's native samples (py-spy, if present): the share spent waiting to take the GIL, and
    the Python functions it spent its time in (``functions``)."""
    pyspy = pyspy_path()
    if pyspy is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        done = subprocess.run([pyspy, "record", "-p", str(pid), "--idle", "--native", "--threads", "-r", "20",
                               "-d", str(seconds), "-f", "raw", "-o", out.name], capture_output=True, text=True)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "py-spy failed"}
        return stack_summary(Path(out.name).read_text(), tid)


def stack_summary(raw: str, tid: int, top: int = 80) -> dict:
    """From py-spy's raw output (``frame;frame;... count`` per line): the thread ``tid``'s samples, the share
    waiting for the GIL, and the ``top`` Python functions by inclusive share that are not on every sample
    (the thread's own loop is), as ``function (dir/file.py)``."""
    total = waiting = 0
    inclusive: dict[str, int] = {}
    for line in raw.splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if f"({tid})" not in frames[0]:  # py-spy's thread frame: "thread (<native id>): <name>"
            continue
        n = int(count)
        total += n
        if "take_gil" in stack or "gil_scoped_acquire" in stack or "PyEval_RestoreThread" in stack:
            waiting += n
        seen = set()
        for frame in frames[1:]:
            name, _, where = frame.partition(" (")
            if ".py:" not in where:
                continue  # a native frame
            file = "/".join(where.rsplit(":", 1)[0].split("/")[-2:])
            seen.add(f"{name} ({file})")
        for key in seen:
            inclusive[key] = inclusive.get(key, 0) + n
    ranked = sorted(((k, v / total) for k, v in inclusive.items() if v < 0.98 * total), key=lambda kv: -kv[1])
    return {"samples": total, "gil_wait_share": round(waiting / total, 3) if total else None,
            "functions": [[k, round(v, 3)] for k, v in ranked[:top]]}


def render(result: dict) -> str:
    from loadtest.machine import cpu_text

    m = result["machine"]
    cells = result["cells"]
    # results written before --pairs have no pair: their server is ours in pair matched; a vllm serve is named
    # by its pair only where the run had more than one (results written before then name it "vllm")
    several = len({c.get("pair") for c in cells if c["server"] == "vllm"}) > 1
    name = [f"{c['server']} ({c['pair']})" if "pair" in c and (c["server"] == "ours" or several) else c["server"]
            for c in cells]
    pairs = sorted({c["pair"] for c in cells if c["server"] == "ours" and "pair" in c}) or ["matched"]
    prompts = f", {result['num_prompts']} requests" if "num_prompts" in result else ""
    lines = ["# Where the model thread's time goes under `vllm bench serve` load: our server vs `vllm serve`", "",
             f"Command: `{result['command']}`  ", f"Date: {result['date']}  ",
             f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, vLLM {m['vllm']}",
             "", f"Data set `{result['set']}` (loadtest.bench_serve){prompts}, pair{'s' if len(pairs) > 1 else ''} "
             f"{', '.join(f'`{p}`' for p in pairs)}. Shares are of one core over the "
             "loaded window (the seconds in which the model thread used more than half a core); the model "
             "thread is our replica's engine thread or the main thread of vLLM's `VLLM::Worker` process.", "",
             "| server | round | output tok/s | median ITL ms | ITL gaps under half / over twice the median | "
             "model thread | other threads, same process | machine idle | steal | GIL wait (py-spy) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for who, c in zip(name, cells):
        gil = c.get("gil")
        gil_text = "not measured" if gil is None else gil.get("error") or f"{gil['gil_wait_share']:.2f} of {gil['samples']}"
        itl = c.get("median_itl_ms")
        shape = (f"{100 * c['itl_under_half_median']:.1f}% / {100 * c['itl_over_twice_median']:.1f}%"
                 if "itl_under_half_median" in c else "-")
        lines.append(f"| {who} | {c['round']} | {c['output_throughput']:.1f} | "
                     f"{'-' if itl is None else f'{itl:.1f}'} | {shape} | {c['model_thread_core_share']:.2f} "
                     f"| {c['other_threads_core_share']:.2f} | {c['machine_idle_share']:.2f} | "
                     f"{c['machine_steal_share']:.2f} | {gil_text} |")
    for who in dict.fromkeys(name):
        shares = [c["model_thread_core_share"] for n, c in zip(name, cells) if n == who]
        lines.append(f"\n{who}: model thread median {st.median(shares):.2f} of a core over {len(shares)} rounds.")
    lines += processes_side_by_side(name, cells)
    side_by_side = functions_side_by_side(name, cells)
    lines += side_by_side
    for who, c in zip(name, cells):
        functions = (c.get("gil") or {}).get("functions")
        if functions and not side_by_side:  # one server's list: the json keeps every list
            lines += ["", f"Python functions of the model thread, {who}, round {c['round']} (share of its "
                      "py-spy samples in which the function is on the stack):", ""]
            lines += [f"- {share:.3f} `{fn}`" for fn, share in functions]
    return "\n".join(lines) + "\n"


def processes_side_by_side(name: list[str], cells: list[dict]) -> list[str]:
    """Each process's CPU over the loaded window, per server (median over its rounds): as a share of one core,
    and in ms per output token (the share over the run's output tokens per second). Processes are named by
    role (``process_role``); a role under 0.005 of a core in a round counts 0 there."""
    per: dict[str, list[dict]] = {}
    for who, c in zip(name, cells):
        if "process_core_shares" in c:
            per.setdefault(who, []).append(c)
    if not per:
        return []
    servers = list(per)
    roles = sorted({r for cs in per.values() for c in cs for r in c["process_core_shares"]})

    def share(who: str, role: str) -> float:
        return st.median(c["process_core_shares"].get(role, 0.0) for c in per[who])

    def per_token(who: str, role: str) -> float:
        return st.median(1000 * c["process_core_shares"].get(role, 0.0) / c["output_throughput"] for c in per[who])

    roles.sort(key=lambda r: (-max(share(w, r) for w in servers), r))
    return ["", "CPU of each process over the loaded window, by role: share of one core, and ms of CPU per output "
            "token (median over rounds; '-' where a server has no such process, or under 0.005 of a core):", "",
            "| process | " + " | ".join(servers) + " |", "|---|" + "---|" * len(servers),
            *[f"| `{role}` | " + " | ".join(
                f"{share(w, role):.3f} ({per_token(w, role):.2f} ms)" if share(w, role) else "-" for w in servers)
              + " |" for role in roles]]


def functions_side_by_side(name: list[str], cells: list[dict], top: int = 60) -> list[str]:
    """Each server's mean share (over its rounds) of the Python functions on its model thread's stack, in
    one table: where two servers differ is what one does per step that the other does not. A function
    missing from a server's list was under the share its list was cut at, or never on its stack."""
    shares: dict[str, dict[str, list[float]]] = {}
    for who, c in zip(name, cells):
        for fn, share in (c.get("gil") or {}).get("functions") or ():
            shares.setdefault(who, {}).setdefault(fn, []).append(share)
    if len(shares) < 2:
        return []
    servers = list(shares)
    mean = {who: {fn: sum(v) / len(v) for fn, v in by_fn.items()} for who, by_fn in shares.items()}
    # Differences between shares both measured first; then functions in some lists only (vLLM's process
    # layout names some frames differently, and a list stops at its top functions), by their largest share
    everywhere = set.intersection(*(set(m) for m in mean.values()))
    spread = {fn: max(m[fn] for m in mean.values()) - min(m[fn] for m in mean.values()) for fn in everywhere}
    rest = {fn: max(m.get(fn, 0.0) for m in mean.values()) for fn in set().union(*mean.values()) - everywhere}
    # ties by name: sets iterate in a per-process order, and the report must re-render the same from its json
    ranked = (sorted(spread, key=lambda fn: (-spread[fn], fn)) + sorted(rest, key=lambda fn: (-rest[fn], fn)))[:top]
    return ["", "Python functions of the model thread side by side: first those in every server's list, the "
            "largest differences first, then those in some lists only, the largest share first (mean share "
            "of each server's py-spy samples over its rounds; '-' where not in its list):", "",
            "| function | " + " | ".join(servers) + " |", "|---|" + "---|" * len(servers),
            *[f"| `{fn}` | " + " | ".join(f"{mean[w][fn]:.3f}" if fn in mean[w] else "-" for w in servers) + " |"
              for fn in ranked]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="short", choices=list(SETS))
    parser.add_argument("--pairs", nargs="+", default=["matched"], choices=PAIRS,
                        help="our server's settings, each a pair of loadtest.bench_serve (vllm serve runs once a round)")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per run; default: the set's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pyspy-s", type=int, default=0, help="seconds of native py-spy sampling, 0: none (py-spy "
                        "pauses the process at each sample, so rounds with it say less about CPU shares and speed)")
    parser.add_argument("--out", default="docs/results/serve-profile")
    args = parser.parse_args(argv)
    if args.pyspy_s > 0 and pyspy_path() is None:
        parser.error("--pyspy-s needs py-spy (pip install py-spy) on PATH or beside this Python")

    from kernels.hardware import resolve_dtype
    from loadtest.machine import publish
    from workers.model_store import DEFAULT_MODEL, DEFAULT_MODEL_NAME, resolve_model

    model_dir = str(resolve_model(DEFAULT_MODEL))
    workdir = Path(tempfile.mkdtemp(prefix="profile-serve-"))
    data = SETS[args.set] if args.num_prompts is None else replace(SETS[args.set], num_prompts=args.num_prompts)
    natural = workdir / "natural.jsonl"
    if args.set in NATURAL_SETS:
        natural_dataset(natural, model_dir, data.num_prompts + 2)
    print(f"logs and raw results: {workdir}", flush=True)
    cells = []
    for r in range(args.rounds):
        servers: list[tuple[str, Server]] = []
        for pair in args.pairs:
            ours, theirs = pair_servers(pair, model_dir, DEFAULT_MODEL_NAME, resolve_dtype("auto", False))
            # a vllm serve that an earlier pair gives the same command runs once (matched, layers-off)
            if all(theirs.command != s.command for _, s in servers):
                servers.append((pair, theirs))
            servers.append((pair, ours))
        for pair, server in (servers if r % 2 == 0 else servers[::-1]):
            cell = profile_one(server, r, args, data, DEFAULT_MODEL_NAME, model_dir, workdir, natural)
            cells.append({**cell, "pair": pair})
            print(json.dumps(cells[-1]), flush=True)
    publish("loadtest.profile_serve", argv, args.out, {"set": args.set, "num_prompts": data.num_prompts,
                                                       "rounds": args.rounds, "cells": cells}, render)
    return 0


def profile_one(server: Server, r: int, args: argparse.Namespace, data: DataSet, model_name: str, model_dir: str,
                workdir: Path, natural: Path) -> dict:
    proc, _ = server.start(workdir, workdir / f"{server.label}-{r}.log")
    try:
        pid = model_process(server.label)
        gil: list[dict | None] = [None]
        with Sampler(pid) as sampler:

            def sample_gil() -> None:
                if sampler.wait_loaded(server.label, _SPY_AFTER_LOADED_S):
                    gil[0] = gil_waits(pid, model_thread(server.label, pid, _threads(pid)), args.pyspy_s)
                else:  # said in the report, not left as "not measured"
                    gil[0] = {"error": f"the run ended before {_SPY_AFTER_LOADED_S} loaded seconds; raise --num-prompts"}

            spy = threading.Thread(target=sample_gil, daemon=True) if args.pyspy_s > 0 else None
            if spy is not None:
                spy.start()
            cell = drive(server, data, model_name, model_dir, workdir, f"{args.set}-{server.label}-{r}", natural)
        if spy is not None:  # after sampling stops: a run shorter than the wait ends the wait too
            spy.join()
        cell.update(sampler.summary(server.label), server=server.label, round=r, gil=gil[0])
        return cell
    finally:
        stop(proc, server.port)


if __name__ == "__main__":
    sys.exit(main())
