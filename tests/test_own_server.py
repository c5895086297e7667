"""The server as a user starts it (``python -m deployments.server``), with an API key and a CORS origin:
who may call it, where its processes run, and how SIGTERM drains it (the last test: it stops the server).

It runs in a process of its own with a Ray instance of its own (``RAY_ADDRESS=local``: never the test
session's cluster), the default model, one replica, eager.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deployments import serve_env
from tests.conftest import _free_port

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 96
# The app's request_timeout_s: streams of TOKENS end well within it, even under SIGTERM's drain on a loaded CI
# machine (at 10 s one did not: the drain test saw its deadline error)
DEADLINE_S = 30
KEY = "sk-test-key"
ORIGIN = "http://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def own_server(tmp_path_factory, model_dir):
    tmp_path = tmp_path_factory.mktemp("own-server")
    port = _free_port()
    config = tmp_path / "app.json"
    config.write_text(json.dumps({"engine": {"enforce_eager": True, "max_model_len": 2048, "max_num_seqs": 4,
                                             "kv_cache_space_gib": 1}, "drain_timeout_s": 60,
                                  "request_timeout_s": DEADLINE_S,
                                  "http": {"api_keys": [KEY], "allowed_origins": [ORIGIN]}}))
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "deployments.server", "--port", str(port), "--config", str(config),
                             "--num-cpus", "2"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            # without what tests/conftest.py set for the session: the server sets it itself
                            env={**{k: v for k, v in os.environ.items()
                                    if k not in serve_env.SERVE_ENV and k != serve_env.THROUGHPUT_SWITCH},
                                 "RAY_ADDRESS": "local"}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the server did not become healthy"
        if '"ready"' in (tmp_path / "server.log").read_text(errors="replace"):  # what a user waits for
            break
        time.sleep(1)
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    _check_cores(proc.pid)
    yield proc, base, tmp_path / "server.log"
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        out += (kids := children.get(todo.pop(), []))
        todo += kids
    return out


def _check_cores(server_pid: int) -> None:
    """deployments.server keeps Ray and Serve on the lowest core (workers.cpu_cores.frontend_cores) and the
    engine off it: pinned to a core of its own, or, when another engine on this machine holds it (the
    test session's), floating over every core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return
    found = {}
    for pid in _descendants(server_pid):
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if "ServeReplica:entropic:OpenAIIngress" in name:
            found["ingress"] = os.sched_getaffinity(pid)
        elif comm.startswith("engine-"):
            found["engine"] = os.sched_getaffinity(pid)
    assert found.get("ingress") == set(cores[:-1]), found
    assert found.get("engine") in ({cores[-1]}, set(cores)), found


def test_an_api_key_guards_the_api_but_not_health_or_metrics(own_server):
    from openai import AuthenticationError, OpenAI

    _, base, _ = own_server
    for path in ("/v1/models", "/debug/requests"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.get(f"{base}{path}", headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
            assert response.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(f"{base}{path}", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200  # probes carry no key
    assert httpx.get(f"{base}/metrics", timeout=30).status_code != 401  # nor does Prometheus
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    assert OpenAI(base_url=f"{base}/v1", api_key=KEY).models.list().data[0].id == "SmolLM2-135M-Instruct"


def test_serve_runs_its_data_plane_as_ray_ships_it(own_server):
    """deployments.serve_env, as the server sets it (the fixture starts it without those variables): Ray's
    Serve controller announces its throughput mode and each setting it changes; here it announces none."""
    _, _, log = own_server
    text = log.read_text(errors="replace")
    assert "(ServeController" in text and "Deploying new version of Deployment" in text  # its log reaches us
    for announced in ("Throughput optimized Ray Serve enabled", "gRPC communication enabled",
                      "User code running in main thread", "Direct ingress enabled", "Log to stderr disabled",
                      "Router running in main thread"):
        assert announced not in text, announced


def test_a_browser_preflight_is_answered_for_allowed_origins_only(own_server):
    _, base, _ = own_server
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight}, timeout=30)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight},
                            timeout=30)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    simple = httpx.get(f"{base}/v1/models", headers={"Origin": ORIGIN, **AUTH}, timeout=30)
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def _engine_processes(pids) -> list[int]:
    found = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("engine-"):
                found.append(int(pid))
        except OSError:  # gone meanwhile
            continue
    return found


def _borrow_counts(base: str) -> dict[str, float]:
    counts = {"borrowed": 0.0, "refused": 0.0}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("entropic_borrowed_core_steps_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] += float(line.rsplit(" ", 1)[1])
    return counts


def test_a_prefill_step_of_the_pinned_engine_borrows_the_serving_core_and_its_decode_steps_do_not(own_server):
    """workers.step_threads on the served path: a prompt of ~300 tokens is one step over
    ``engine.borrow_min_tokens``; its 8 decode steps are under it, and borrow by context only where configured.
    One replica: the request reaches this engine whatever the router does."""
    proc, base, _ = own_server
    engines = _engine_processes(_descendants(proc.pid))
    assert len(engines) == 1, engines
    if os.sched_getaffinity(engines[0]) == os.sched_getaffinity(0):
        pytest.skip("the engine floats (another engine on this machine holds the core it would pin): it borrows not")
    before = _borrow_counts(base)
    prompt = f"{time.time()} " + "The quick brown fox jumps over the lazy dog. " * 30  # no prefix-cache hit
    response = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] >= 300, response.text
    deadline = time.monotonic() + 15  # the replica's metrics reach the page once a second
    while sum(_borrow_counts(base).values()) == sum(before.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2.5)  # two more reports: any decode step that borrowed would show by now
    after = _borrow_counts(base)
    gained = {k: after[k] - before[k] for k in after}
    # one large step; it finds the core lent only if another engine of this machine borrowed it at that moment
    assert gained["borrowed"] + gained["refused"] == 1, gained
    if _engine_processes(filter(str.isdigit, os.listdir("/proc"))) == engines:  # no other engine here
        assert gained["borrowed"] == 1, gained


def test_a_request_past_its_deadline_gets_408_or_an_in_band_error_and_the_engine_lets_go(own_server):
    _, base, _ = own_server
    # Two requests of two choices of 2000 tokens each, at once (max_num_seqs is 4: all four sequences start
    # together) on one 1-thread engine: about 50 s and more, well past the deadline, which finds them generating
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 2000, "n": 2,
            "ignore_eos": True, "temperature": 0}

    def streamed() -> list[str]:
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=300) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line]

    with cf.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        stream = pool.submit(streamed)
        response = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=300)
        elapsed = time.monotonic() - started
        lines = stream.result(timeout=300)
    assert response.status_code == 408, response.text
    assert response.json()["error"]["type"] == "RequestTimeoutError"
    assert DEADLINE_S <= elapsed < DEADLINE_S + 10
    assert len(lines) > 3 and "RequestTimeoutError" in lines[-2] and lines[-1] == "data: [DONE]"
    # the engine let go of the four sequences: a short request is served at once, not after them
    started = time.monotonic()
    quick = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 2, "n": 1}, headers=AUTH, timeout=60)
    assert quick.status_code == 200 and time.monotonic() - started < 8


def _stream(base: str, out: dict) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": TOKENS, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    lines = []
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=300) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    out["started"] = True
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["lines"], out["ended"] = lines, time.monotonic()


def test_sigterm_lets_streams_finish_and_refuses_new_requests_meanwhile(own_server):
    proc, base, log = own_server
    streams = [{} for _ in range(2)]
    threads = [threading.Thread(target=_stream, args=(base, out)) for out in streams]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not all(s.get("started") for s in streams):
        assert time.monotonic() < deadline, streams
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    probes = []  # (status, retry-after, error type) of requests sent while the streams run
    while any(t.is_alive() for t in threads):
        try:
            r = httpx.post(f"{base}/v1/completions", timeout=30, headers=AUTH,
                           json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2})
            probes.append((r.status_code, r.headers.get("retry-after"), r.json().get("error", {}).get("type")))
        except httpx.ConnectError:
            probes.append(("refused", None, None))
        except (httpx.RemoteProtocolError, httpx.ReadError):
            # Serve's proxy is killed without closing its socket first (ProxyActor.shutdown does nothing), so
            # a probe that meets serve.shutdown() is cut; that may only happen once the drain is over
            assert "drained (" in log.read_text(errors="replace"), (probes, log.read_text()[-3000:])
            probes.append(("cut", None, None))
        time.sleep(0.2)
    for t in threads:
        t.join()
    for s in streams:  # every stream ran to its end: all its tokens, the usage chunk, then [DONE]
        assert "error" not in s and s["status"] == 200, s
        assert s["lines"][-1] == "data: [DONE]", s["lines"][-3:]
        usage = json.loads(s["lines"][-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == TOKENS
    answered = [p for p in probes if p[0] not in ("refused", "cut")]
    # The drain begins once the signal has reached the server's main thread and the ingress has been told
    # (a Ray call): a probe that arrives before that is served in full, as it should be (a CI run: one 200,
    # then only 503s). From the first 503 on, nothing new is served.
    first_refusal = next((i for i, p in enumerate(answered) if p[0] == 503), None)
    assert first_refusal is not None, f"no request was refused while the streams drained: {probes}"
    assert all(p[0] == 200 for p in answered[:first_refusal]), probes
    assert all(p == (503, "5", "ServiceUnavailableError") for p in answered[first_refusal:]), probes
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
