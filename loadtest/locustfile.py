"""Locust load test against the OpenAI API, measured as ``vllm bench serve`` measures.

Four workloads, each a streamed request that ends at EOS (``max_tokens`` only as a loose bound), its
output tokens counted from the response's ``usage`` (``stream_options.include_usage``):

- ``chat``: a short question (chat completions);
- ``long``: ~2K tokens of Python's documentation, from a random place so the prefix cache rarely helps,
  and a question about it: long enough that KV pruning runs (it stays dense below 1024 tokens);
- ``free``: free-form writing (completions);
- ``entropic``: a chat request that sets ``entropic`` fields (a target entropy, the pruning budget).

Closed loop, Locust's own way (each user waits for its answer, then ``wait_time``)::

    locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 2m --host http://127.0.0.1:8000

Open loop, as ``vllm bench serve --request-rate`` (requests arrive at a rate whether or not earlier ones are
answered; Poisson or evenly spaced; one Locust user issues them all)::

    LOCUST_RATE=1.5 LOCUST_ARRIVALS=poisson locust -f loadtest/locustfile.py --headless -u 1 -t 2m --host ...

``LOCUST_SHAPE=steady|burst`` replaces ``-u/-r/-t`` in closed loop. ``LOCUST_MIX=chat:3,long:1,...`` weighs the
workloads (interleaved in those proportions, not drawn at random, so every one is sent early in a run).
``LOCUST_REPORT=PATH`` writes ``PATH.json``, ``PATH.md`` and ``PATH.png`` when the run ends.

Metrics as ``vllm bench serve`` defines them (``loadtest/request_metrics.py`` says how). Locust's own table
shows them too, as rows ``<workload> ttft``, ``tpot``, ``itl`` (one entry per gap) and ``e2e``, in ms.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gevent
from locust import HttpUser, LoadTestShape, between, events, task

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # Locust puts only loadtest/ on the path
from loadtest.request_metrics import Outcome, summarize, write_report  # noqa: E402

MODEL = os.environ.get("LOCUST_MODEL", "SmolLM2-135M-Instruct")
MAX_TOKENS = int(os.environ.get("LOCUST_MAX_TOKENS", "256"))  # a bound on every workload's: outputs end at EOS
LONG_CHARS = int(os.environ.get("LOCUST_LONG_CHARS", "8000"))  # ~2K tokens of English prose
RATE = float(os.environ.get("LOCUST_RATE", "0"))  # requests/s; 0: closed loop
ARRIVALS = os.environ.get("LOCUST_ARRIVALS", "poisson")  # poisson | constant
REPORT = os.environ.get("LOCUST_REPORT")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for better sleep.",
    "Write a haiku about autumn.",
    "Explain what a hash table is in two sentences.",
    "Name three planets of the solar system.",
    "What do bees make?",
]
FREE_PROMPTS = ["Once upon a time,", "The best way to learn programming is", "In 1969, astronauts",
                "The old lighthouse keeper opened the door and"]
LONG_QUESTION = "\n\nIn one sentence, what is the text above about?"


def _prose() -> str:
    import pydoc_data.topics as topics  # Python's own documentation: shipped with every CPython

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


_PROSE = _prose()


@dataclass(frozen=True)
class Request:
    workload: str
    path: str
    body: dict


def chat(rng: random.Random) -> Request:
    return Request("chat", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": rng.choice(CHAT_PROMPTS)}]})


def long(rng: random.Random) -> Request:
    start = rng.randrange(0, len(_PROSE) - LONG_CHARS)
    return Request("long", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": _PROSE[start:start + LONG_CHARS] + LONG_QUESTION}],
        "max_tokens": 64})


def free(rng: random.Random) -> Request:
    return Request("free", "/v1/completions", {"prompt": rng.choice(FREE_PROMPTS), "temperature": 1.0})


def entropic(rng: random.Random) -> Request:
    return Request("entropic", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": rng.choice(CHAT_PROMPTS)}],
        "entropic": {"target_entropy": rng.choice([1.0, 2.0]), "pruning": {"keep_min": 0.5}}})


WORKLOADS = {"chat": chat, "long": long, "free": free, "entropic": entropic}


def _mix() -> dict[str, float]:
    spec = os.environ.get("LOCUST_MIX", "chat:3,long:1,free:1,entropic:1")
    mix = {name: float(weight) for name, weight in (part.split(":") for part in spec.split(","))}
    unknown = set(mix) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"LOCUST_MIX names unknown workloads {sorted(unknown)}; known: {sorted(WORKLOADS)}")
    return mix


MIX = _mix()


OUTCOMES: list[Outcome] = []
PENDING: set = set()  # open loop: requests sent and not yet answered
DRAIN_S = float(os.environ.get("LOCUST_DRAIN_S", "300"))  # open loop: how long the end of a run waits for them


def send(user: HttpUser, request: Request) -> Outcome:
    """Stream one request and report it to Locust: the HTTP row, then the ttft/tpot/itl/e2e rows."""
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, **request.body,
            "max_tokens": min(request.body.get("max_tokens", MAX_TOKENS), MAX_TOKENS)}
    outcome = Outcome(request.workload, time.time())
    start = last = time.perf_counter()
    with user.client.post(request.path, json=body, stream=True, name=request.workload,
                          catch_response=True) as response:
        try:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            done = False
            for raw in response.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                payload = json.loads(line[6:])
                if "error" in payload:
                    raise RuntimeError(payload["error"].get("message"))
                if payload.get("usage"):
                    outcome.output_tokens = payload["usage"]["completion_tokens"]
                    outcome.prompt_tokens = payload["usage"]["prompt_tokens"]
                if not any(c.get("text") or (c.get("delta") or {}).get("content")
                           for c in payload.get("choices", [])):
                    continue
                now = time.perf_counter()
                if outcome.ttft is None:
                    outcome.ttft = now - start
                else:
                    outcome.itl.append(now - last)
                last = now
            if not done:
                raise RuntimeError("stream ended without [DONE]")
            if not outcome.output_tokens:
                raise RuntimeError("no usage in the stream")
            outcome.ok = True
            response.success()
        except Exception as exc:  # reported to Locust as a failure, never raised out of the user
            outcome.error = f"{type(exc).__name__}: {exc}"[:300]
            response.failure(exc)
    outcome.e2e = time.perf_counter() - start
    OUTCOMES.append(outcome)
    exception = None if outcome.ok else RuntimeError(outcome.error)
    fire = user.environment.events.request.fire
    rows = [("ttft", outcome.ttft or outcome.e2e), ("tpot", outcome.tpot), ("e2e", outcome.e2e)]
    rows += [("itl", gap) for gap in outcome.itl]
    for metric, value in rows:
        if value is not None:
            fire(request_type="SSE", name=f"{request.workload} {metric}", response_time=1e3 * value,
                 response_length=outcome.output_tokens if metric == "e2e" else 0, exception=exception, context={})
    return outcome


_CREDIT = dict.fromkeys(MIX, 0.0)


def _draw(rng: random.Random) -> Request:
    """The next workload of the run, in the mix's proportions interleaved smoothly (nginx's smooth weighted
    round robin over all users): a short run still sends every workload early, where independent random
    draws could leave one out of it altogether."""
    for name, weight in MIX.items():
        _CREDIT[name] += weight
    name = max(_CREDIT, key=_CREDIT.__getitem__)
    _CREDIT[name] -= sum(MIX.values())
    return WORKLOADS[name](rng)


if RATE > 0:
    class OpenLoopUser(HttpUser):
        """Issues every request of the run, at LOCUST_RATE per second, without waiting for answers."""

        fixed_count = 1

        @task
        def arrive(self) -> None:
            rng = random.Random()
            while True:
                gevent.sleep(rng.expovariate(RATE) if ARRIVALS == "poisson" else 1.0 / RATE)
                request = gevent.spawn(send, self, _draw(rng))
                PENDING.add(request)
                request.link(PENDING.discard)

else:
    class StreamingUser(HttpUser):
        wait_time = between(0.5, 2.0)

        @task
        def one(self) -> None:
            send(self, _draw(random.Random()))


_SHAPE = os.environ.get("LOCUST_SHAPE")

if _SHAPE == "steady" and RATE == 0:
    class SteadyShape(LoadTestShape):
        """8 users for two minutes."""

        def tick(self):
            return (8, 2) if self.get_run_time() < 120 else None

elif _SHAPE == "burst" and RATE == 0:
    class BurstShape(LoadTestShape):
        """2 users, with a 16-user burst for 15 s every minute, for three minutes."""

        def tick(self):
            t = self.get_run_time()
            if t >= 180:
                return None
            return (16, 16) if t % 60 >= 45 else (2, 2)


_RUN: dict = {}


@events.test_start.add_listener
def _started(environment, **kwargs) -> None:
    OUTCOMES.clear()
    _RUN["start"] = time.time()


@events.quitting.add_listener
def _quitting(environment, **kwargs) -> None:
    if not REPORT or "start" not in _RUN:
        return
    if PENDING:  # open loop: as vllm bench serve, every request sent is answered before the summary
        gevent.joinall(list(PENDING), timeout=DRAIN_S)
    ends = [o.start + o.e2e for o in OUTCOMES if o.e2e is not None]
    duration = max([time.time() if RATE == 0 else 0.0, *ends]) - _RUN["start"]
    settings = {"mode": f"open loop, {ARRIVALS} arrivals at {RATE}/s" if RATE > 0 else "closed loop",
                "mix": MIX, "max_tokens": MAX_TOKENS, "long_chars": LONG_CHARS, "model": MODEL,
                "host": environment.host, "command": " ".join(["locust", *sys.argv[1:]])}
    write_report(REPORT, summarize(list(OUTCOMES), duration), list(OUTCOMES), settings)
