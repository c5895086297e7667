"""Locust load test: streaming chat and completion users against the OpenAI API.

Reports, besides Locust's per-request rows, three SSE metrics per request:
``ttft`` (time to first token), ``itl`` (mean inter-token gap), ``e2e`` (whole stream), in ms.

    locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 2m --host http://127.0.0.1:8000
    LOCUST_SHAPE=burst locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000

LOCUST_SHAPE=steady|burst replaces -u/-r/-t with a built-in scenario (see the shapes below).
"""
from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, LoadTestShape, between, task

MODEL = os.environ.get("LOCUST_MODEL", "SmolLM2-135M-Instruct")
MAX_TOKENS = int(os.environ.get("LOCUST_MAX_TOKENS", "48"))
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for better sleep.",
    "Write a haiku about autumn.",
    "Explain what a hash table is in two sentences.",
]
COMPLETION_PROMPTS = ["Once upon a time,", "The best way to learn programming is", "In 1969, astronauts"]


class StreamingUser(HttpUser):
    wait_time = between(0.5, 2.0)

    def _stream(self, path: str, name: str, body: dict) -> None:
        events = self.environment.events
        start = time.perf_counter()
        first = last = None
        gaps: list[float] = []
        exception = None
        with self.client.post(path, json=body, stream=True, name=name, catch_response=True) as response:
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
                    if not any(c.get("text") or (c.get("delta") or {}).get("content") for c in payload.get("choices", [])):
                        continue
                    now = time.perf_counter()
                    if first is None or last is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                if not done:
                    raise RuntimeError("stream ended without [DONE]")
                response.success()
            except Exception as exc:  # reported to Locust as a failure, never raised out of the user
                exception = exc
                response.failure(exc)
        end = time.perf_counter()
        for metric, value in (("ttft", (first or end) - start), ("itl", sum(gaps) / len(gaps) if gaps else 0.0),
                              ("e2e", end - start)):
            events.request.fire(request_type="SSE", name=f"{name} {metric}", response_time=1e3 * value,
                                response_length=0, exception=exception, context={})

    @task(3)
    def chat(self) -> None:
        self._stream("/v1/chat/completions", "chat", {
            "model": MODEL, "stream": True, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": random.choice(CHAT_PROMPTS)}]})

    @task(1)
    def completion(self) -> None:
        self._stream("/v1/completions", "completion", {
            "model": MODEL, "stream": True, "max_tokens": MAX_TOKENS, "prompt": random.choice(COMPLETION_PROMPTS)})


_SHAPE = os.environ.get("LOCUST_SHAPE")

if _SHAPE == "steady":
    class SteadyShape(LoadTestShape):
        """8 users for two minutes."""

        def tick(self):
            return (8, 2) if self.get_run_time() < 120 else None

elif _SHAPE == "burst":
    class BurstShape(LoadTestShape):
        """2 users, with a 16-user burst for 15 s every minute, for three minutes."""

        def tick(self):
            t = self.get_run_time()
            if t >= 180:
                return None
            return (16, 16) if t % 60 >= 45 else (2, 2)
