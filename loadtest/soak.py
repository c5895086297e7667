"""Soak: mixed load for a long while against the server as ``make serve`` starts it, with poison inputs,
client disconnects, one worker replica and the controller killed midway (issue: reliability).

    make soak ARGS="--minutes 30"   (writes docs/results/soak.{md,json})

The server is ``python -m deployments.server --num-replicas 2`` (the shipped defaults otherwise), in a
Ray instance of its own. Requests arrive open-loop (Poisson, ``--rate``), each one of:

* ``chat``: a short question, streamed or not, up to 64 tokens;
* ``long``: a ~1.9K-token prompt with a question at its end (engages KV pruning), up to 32 tokens;
* ``free``: free-form writing, streamed, up to 256 tokens;
* ``poison``: a request vLLM's engine would once have died of (bad token ids, an unclosed regex, deep
  nesting, a lone surrogate, template kwargs); must get a 400 with an OpenAI error object;
* ``disconnect``: a free-form stream the client drops after a few chunks.

At 35% of the run one worker replica's process is killed with SIGKILL (as the OOM killer would), at 65%
the controller's; Serve replaces both. Every request ends in one outcome: ``ok``, ``rejected`` (the 400
a poison input must get), ``shed`` (429/503 with Retry-After), ``in_band_error`` (a stream that started
and then carried an error), ``server_error`` (any other 5xx), ``transport`` (no HTTP answer), ``wrong``
(a poison input that got anything but a 400, or a normal one that got a 4xx), ``disconnected``. Every 10 s
the resident memory of each Serve replica process, engine process and Serve proxy is sampled.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics as st
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.stats import percentile
from loadtest.workload import CHECKABLE, FILLER, FREE_FORM

MODEL = "SmolLM2-135M-Instruct"
MIX = {"chat": 0.55, "long": 0.15, "free": 0.2, "poison": 0.05, "disconnect": 0.05}
_CHAT = "/v1/chat/completions"
POISON: list[tuple[str, bytes]] = [
    (_CHAT, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                        "stop_token_ids": [-1]}).encode()),
    (_CHAT, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                        "logit_bias": {"99999999": 5}}).encode()),
    (_CHAT, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                        "allowed_token_ids": [-3]}).encode()),
    (_CHAT, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                        "structured_outputs": {"regex": "(unclosed["}}).encode()),
    (_CHAT, json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                        "chat_template_kwargs": {"tokenize": True}}).encode()),
    (_CHAT, b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    (_CHAT, b'{"model": "x", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
]
LONG_PROMPT = FILLER * 80 + "Question: what colour is the sky in the text above? Answer in one word."


def _pick(rng: random.Random) -> str:
    return rng.choices(list(MIX), list(MIX.values()))[0]


async def one(client, base: str, kind: str, rng: random.Random, t0: float) -> dict:
    try:
        return await _one(client, base, kind, rng, t0)
    except Exception as exc:  # a bug here, not the server's: kept apart so it cannot hide among outcomes
        return {"kind": kind, "sent": time.monotonic() - t0, "outcome": "harness_error", "error": repr(exc)}


async def _one(client, base: str, kind: str, rng: random.Random, t0: float) -> dict:
    row: dict = {"kind": kind, "sent": time.monotonic() - t0}
    stream, path, body, drop_after = True, _CHAT, None, None
    if kind == "poison":
        path, raw = rng.choice(POISON)
        return await _plain(client, base + path, raw, row, t0, expect_400=True)
    if kind == "chat":
        question = rng.choice([q for q, _ in CHECKABLE])
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 64}
        stream = rng.random() < 0.5
    elif kind == "long":
        body = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 32}
    else:
        body = {"messages": [{"role": "user", "content": rng.choice(FREE_FORM)}], "max_tokens": 256,
                "temperature": 0.8}
        drop_after = 5 if kind == "disconnect" else None
    body = {"model": MODEL, "stream": stream, **body}
    if not stream:
        return await _plain(client, base + path, json.dumps(body).encode(), row, t0, expect_400=False)
    return await _stream(client, base + path, body, row, t0, drop_after)


async def _plain(client, url: str, raw: bytes, row: dict, t0: float, expect_400: bool) -> dict:
    import httpx

    try:
        r = await client.post(url, content=raw, headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        return {**row, "outcome": "transport", "error": type(exc).__name__, "ended": time.monotonic() - t0}
    row.update(status=r.status_code, ended=time.monotonic() - t0)
    row["e2e"] = row["ended"] - row["sent"]
    return {**row, "outcome": _outcome(r.status_code, r.headers, _json(r.text), expect_400)}


def _json(text: str) -> dict:
    try:
        out = json.loads(text)
        return out if isinstance(out, dict) else {}
    except ValueError:
        return {}


def _outcome(status: int, headers, body: dict, expect_400: bool) -> str:
    openai_error = isinstance(body.get("error"), dict) and "message" in body["error"]
    if expect_400:
        return "rejected" if status == 400 and openai_error else "wrong"
    if status == 200:
        return "ok"
    if status in (429, 503) and headers.get("retry-after") and openai_error:
        return "shed"
    return "server_error" if status >= 500 else "wrong"


async def _stream(client, url: str, body: dict, row: dict, t0: float, drop_after: int | None) -> dict:
    import httpx

    chunks, first = 0, None
    try:
        async with client.stream("POST", url, json=body) as r:
            row["status"] = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                row["ended"] = time.monotonic() - t0
                return {**row, "outcome": _outcome(r.status_code, r.headers, _json(text), False)}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                if "error" in _json(line[6:]):
                    row["ended"] = time.monotonic() - t0
                    return {**row, "outcome": "in_band_error", "chunks": chunks}
                chunks += 1
                first = first or time.monotonic() - t0
                if drop_after is not None and chunks >= drop_after:
                    row["ended"] = time.monotonic() - t0
                    return {**row, "outcome": "disconnected", "chunks": chunks}
            else:
                row["ended"] = time.monotonic() - t0
                return {**row, "outcome": "transport", "error": "stream ended without [DONE]", "chunks": chunks}
    except httpx.HTTPError as exc:
        row["ended"] = time.monotonic() - t0
        return {**row, "outcome": "transport", "error": type(exc).__name__, "chunks": chunks}
    row["ended"] = time.monotonic() - t0
    row.update(chunks=chunks, ttft=(first - row["sent"]) if first else None, e2e=row["ended"] - row["sent"])
    return {**row, "outcome": "ok"}


def _processes() -> dict[int, str]:
    """pid -> role of every Serve replica process, engine process and Serve proxy on this machine."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("engine-"):
            out[int(pid)] = "engine"
        elif "ServeReplica:entropic:" in cmd:
            out[int(pid)] = cmd.split("ServeReplica:entropic:", 1)[1].split()[0]
        elif cmd.startswith("ray::ProxyActor"):
            out[int(pid)] = "ProxyActor"
    return out


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _kill(role: str) -> int | None:
    victims = sorted(pid for pid, r in _processes().items() if r == role)
    if not victims:
        return None
    os.kill(victims[0], signal.SIGKILL)
    return victims[0]


async def drive(base: str, args: argparse.Namespace) -> tuple[list[dict], list[dict], list[dict]]:
    import httpx

    rng = random.Random(args.seed)
    duration = args.minutes * 60
    t0 = time.monotonic()
    rows: list[dict] = []
    events: list[dict] = []
    memory: list[dict] = []
    tasks: set[asyncio.Task] = set()
    kills = [(0.35 * duration, "EntropicWorker"), (0.65 * duration, "EntropyController")]

    async def sample_memory() -> None:
        while time.monotonic() - t0 < duration:
            now = time.monotonic() - t0
            for pid, role in _processes().items():
                rss = _rss_mib(pid)
                if rss is not None:
                    memory.append({"t": round(now, 1), "pid": pid, "role": role, "rss_mib": round(rss, 1)})
            await asyncio.sleep(10)

    def finished(task: asyncio.Task) -> None:
        tasks.discard(task)
        rows.append(task.result())

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        sampler = asyncio.create_task(sample_memory())
        next_at = 0.0
        while (now := time.monotonic() - t0) < duration:
            while kills and now >= kills[0][0]:
                at, role = kills.pop(0)
                events.append({"t": round(now, 1), "killed": role, "pid": _kill(role)})
                print(f"{now:.0f}s: killed {role} {events[-1]['pid']}", file=sys.stderr, flush=True)
            if now >= next_at:
                task = asyncio.create_task(one(client, base, _pick(rng), rng, t0))
                tasks.add(task)
                task.add_done_callback(finished)
                next_at += rng.expovariate(args.rate)
            await asyncio.sleep(max(0.0, min(next_at - now, 0.5)))
        if tasks:
            await asyncio.wait(tasks, timeout=600)
        sampler.cancel()
    return rows, events, memory


def summarize(rows: list[dict], memory: list[dict], minutes: float) -> dict:
    outcomes: dict[str, dict[str, int]] = {}
    for row in rows:
        by_kind = outcomes.setdefault(row["outcome"], {})
        by_kind[row["kind"]] = by_kind.get(row["kind"], 0) + 1
    windows = []
    for start in range(0, int(minutes * 60), 120):
        ok = [r for r in rows if r["outcome"] == "ok" and start <= r["sent"] < start + 120 and r.get("e2e")]
        chat = [r["e2e"] for r in ok if r["kind"] == "chat"]
        ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
        bad = sum(1 for r in rows if start <= r["sent"] < start + 120
                  and r["outcome"] in ("server_error", "in_band_error", "transport", "wrong"))
        windows.append({"from_s": start, "ok": len(ok), "failed": bad, "chat_p50_s": percentile(chat, 0.5),
                        "chat_p99_s": percentile(chat, 0.99), "ttft_p50_s": percentile(ttft, 0.5)})
    return {"outcomes": outcomes, "windows": windows, "rss_after_warmup": memory_growth(memory, 0.2 * minutes * 60)}


def memory_growth(memory: list[dict], warm_s: float) -> dict[str, dict]:
    """RSS growth of each process from its first sample ``warm_s`` after its own first sample: a replacement
    started midway (a killed replica's engine) warms up as the first ones did, loading its model included."""
    growth = {}
    for pid in sorted({m["pid"] for m in memory}):
        own = [m for m in memory if m["pid"] == pid]
        series = [m for m in own if m["t"] >= own[0]["t"] + warm_s]
        if len(series) >= 2:
            growth[str(pid)] = {"role": series[0]["role"], "from_mib": series[0]["rss_mib"],
                                "to_mib": series[-1]["rss_mib"], "over_s": series[-1]["t"] - series[0]["t"],
                                "growth": series[-1]["rss_mib"] / series[0]["rss_mib"] - 1}
    return growth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals, requests/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/results/soak")
    parser.add_argument("--resummarize", metavar="RESULT", help="recompute the memory table of a published result "
                        "(RESULT.json, its saved samples) with this version's summary, and rewrite RESULT.{json,md}")
    args = parser.parse_args(argv)
    if args.resummarize:
        return resummarize(Path(args.resummarize), argv)

    import httpx

    from loadtest.machine import publish
    from loadtest.served_app import _free_port

    port = _free_port()
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    log = workdir / "server.log"
    print(f"server log: {log}", file=sys.stderr, flush=True)
    server = subprocess.Popen([sys.executable, "-m", "deployments.server", "--port", str(port), "--num-replicas", "2"],
                              stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "RAY_ADDRESS": "local"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1200
        while '"ready"' not in log.read_text(errors="replace"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {log}")
            time.sleep(2)
        while httpx.get(f"{base}/health", timeout=10).status_code != 200:
            time.sleep(1)
        rows, events, memory = asyncio.run(drive(base, args))
    finally:
        server.send_signal(signal.SIGTERM)  # drains, then exits
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    summary = summarize(rows, memory, args.minutes)
    publish("loadtest.soak", argv, args.out,
            {"settings": vars(args), "mix": MIX, "requests": len(rows), "events": events, **summary,
             "memory_samples": memory}, _markdown)
    return 0


def resummarize(result_path: Path, argv: list[str] | None) -> int:
    """The run's samples are in its JSON: a fix to how they are read needs no second 30-minute run."""
    from datetime import datetime, timezone

    path = result_path.with_name(result_path.name + ".json")
    result = json.loads(path.read_text())
    result["rss_after_warmup"] = memory_growth(result["memory_samples"], 0.2 * result["settings"]["minutes"] * 60)
    result["resummarized"] = {"command": "python -m loadtest.soak " + shlex.join(argv if argv is not None else sys.argv[1:]),
                              "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path.write_text(json.dumps(result, indent=2))
    text = _markdown(result)
    result_path.with_name(result_path.name + ".md").write_text(text)
    print(text)
    return 0


def _markdown(result: dict) -> str:
    from loadtest.machine import cpu_text

    m = result["machine"]
    lines = ["# Soak: mixed load with poison inputs, disconnects and two kills", "",
             f"Command: `{result['command']}`  ", f"Date: {result['date']}  ",
             f"Machine: {cpu_text(m)}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, vLLM {m['vllm']}",
             "", f"`python -m deployments.server --num-replicas 2` for {result['settings']['minutes']} minutes, "
             f"{result['settings']['rate']} requests/s (Poisson), mix {result['mix']}; {result['requests']} requests. "
             "Kills: " + "; ".join(f"{e['killed']} (pid {e['pid']}) at {e['t']:.0f} s" for e in result["events"]),
             "", "## Outcomes", "", "| outcome | requests by kind |", "|---|---|"]
    if "resummarized" in result:
        again = result["resummarized"]
        lines[5:5] = ["", f"Memory table recomputed from the run's samples on {again['date']}: `{again['command']}`"]
    for outcome, by_kind in sorted(result["outcomes"].items()):
        lines.append(f"| {outcome} | {', '.join(f'{k}: {n}' for k, n in sorted(by_kind.items()))} |")
    lines += ["", "## Over time (2-minute windows, by send time)", "",
              "| from | ok | failed | chat e2e p50 | chat e2e p99 | TTFT p50 (streams) |", "|---|---|---|---|---|---|"]

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    for w in result["windows"]:
        lines.append(f"| {w['from_s']} s | {w['ok']} | {w['failed']} | {s(w['chat_p50_s'])} | {s(w['chat_p99_s'])} "
                     f"| {s(w['ttft_p50_s'])} |")
    lines += ["", "## Resident memory after warm-up (a process's own first 20% of the run's length)", "",
              "| process | pid | from | to | over | growth |", "|---|---|---|---|---|---|"]
    for pid, g in result["rss_after_warmup"].items():
        lines.append(f"| {g['role']} | {pid} | {g['from_mib']:.0f} MiB | {g['to_mib']:.0f} MiB | {g['over_s']:.0f} s "
                     f"| {100 * g['growth']:+.1f}% |")
    growths = [g["growth"] for g in result["rss_after_warmup"].values()]
    if growths:
        lines.append(f"\nLargest growth {100 * max(growths):+.1f}%, median {100 * st.median(growths):+.1f}%.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
