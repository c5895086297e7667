"""loadtest/profile_serve.py's accounting, on samples whose answer is known (the tool itself needs two servers)."""
import os
import time

import pytest

from loadtest.profile_serve import Sampler


def test_the_loaded_window_and_the_shares_over_it():
    hz = os.sysconf("SC_CLK_TCK")
    sampler = Sampler(pid=100)  # vLLM's worker: the model runs on the process's main thread (tid == pid)
    model_per_s = [0.0, 0.9, 0.9, 0.9, 0.1]  # idle, three loaded seconds, idle
    model = other = total = idle = 0
    sampler.samples.append((0.0, {100: ("VLLM::Worker", 0), 101: ("gloo", 0)}, (0, 0, 0)))
    for second, share in enumerate(model_per_s, start=1):
        model += round(share * hz)
        other += round(0.1 * hz)
        total += 2 * hz  # two cores
        idle += round(0.5 * hz)  # a quarter of the machine idle
        sampler.samples.append((float(second), {100: ("VLLM::Worker", model), 101: ("gloo", other)},
                                (total, idle, 0)))
    summary = sampler.summary("vllm")
    assert summary["window_s"] == pytest.approx(3.0)
    assert summary["model_thread_core_share"] == pytest.approx(0.9, abs=0.01)
    assert summary["other_threads_core_share"] == pytest.approx(0.1, abs=0.01)
    assert summary["machine_idle_share"] == pytest.approx(0.25, abs=0.01)


def test_a_model_thread_that_never_worked_is_an_error():
    sampler = Sampler(pid=100)
    sampler.samples += [(float(t), {100: ("VLLM::Worker", 0)}, (200 * t, 200 * t, 0)) for t in range(3)]
    with pytest.raises(RuntimeError, match="never used half a core"):
        sampler.summary("vllm")


def test_stacks_give_the_gil_wait_and_the_python_functions_of_the_model_thread_only():
    from loadtest.profile_serve import stack_summary

    loop = "thread (0x1 (100)): vllm-engine;_loop (workers/engine.py:330)"
    raw = "\n".join([
        f"{loop};step (vllm/v1/engine/core.py:10);forward (models/llama.py:5);gemm (libtorch_cpu.so) 6",
        f"{loop};step (vllm/v1/engine/core.py:10);apply (workers/sampling.py:166);exp (libtorch_cpu.so) 3",
        f"{loop};take_gil (libpython3.11.so) 1",
        "thread (0x2 (101)): other;run (threading.py:1) 50",  # another thread: not counted
    ])
    summary = stack_summary(raw, 100)
    assert summary["samples"] == 10 and summary["gil_wait_share"] == 0.1
    assert summary["functions"] == [["step (engine/core.py)", 0.9], ["forward (models/llama.py)", 0.6],
                                    ["apply (workers/sampling.py)", 0.3]]


def test_our_model_thread_is_the_first_of_the_threads_named_vllm_engine():
    """A pinned engine that may borrow a core starts an OpenMP worker, which inherits the engine thread's
    name (a profile run failed on the two): the engine thread is the one started first."""
    from loadtest.profile_serve import model_thread

    threads = {7: ("engine-r1", 0), 12: ("vllm-engine", 0), 15: ("vllm-engine", 0), 9: ("gloo_tcp_loop", 0)}
    assert model_thread("ours", 7, threads) == 12
    with pytest.raises(RuntimeError, match="no thread named vllm-engine"):
        model_thread("ours", 7, {7: ("engine-r1", 0)})


def test_py_spy_waits_for_the_loaded_seconds_it_asks_for():
    """The short set ends in ~25 s on a fast host: a fixed delay before py-spy started sampled nothing (a run
    gave no GIL figure); it now starts once the model thread has been loaded for the seconds asked."""
    hz = os.sysconf("SC_CLK_TCK")
    sampler = Sampler(pid=100)
    sampler.samples += [(float(t), {100: ("VLLM::Worker", hz * max(0, t - 2))}, (0, 0, 0)) for t in range(6)]
    assert sampler.wait_loaded("vllm", 3, timeout_s=1.0)  # loaded in seconds 2-3, 3-4 and 4-5
    assert not sampler.wait_loaded("vllm", 4, timeout_s=0.1)
    sampler._stop.set()  # the run ended before four loaded seconds: no waiting out the timeout
    started = time.monotonic()
    assert not sampler.wait_loaded("vllm", 4, timeout_s=60.0)
    assert time.monotonic() - started < 5.0


def test_the_report_names_our_server_by_its_pair():
    from loadtest.profile_serve import render

    def cell(server: str, pair: str, tok_s: float) -> dict:
        return {"server": server, "pair": pair, "round": 0, "output_throughput": tok_s, "median_itl_ms": 40.0,
                "model_thread_core_share": 0.9, "other_threads_core_share": 0.1, "machine_idle_share": 0.2,
                "machine_steal_share": 0.0, "gil": None}

    result = {"machine": {"cpu": "test cpu", "flags": [], "cores": 2, "memory_gib": 8, "torch": "t", "vllm": "v"},
              "command": "python -m loadtest.profile_serve", "date": "today", "set": "short", "num_prompts": 160,
              "cells": [cell("vllm", "vllm", 280.0), cell("ours", "matched", 285.0), cell("ours", "layers-off", 290.0)]}
    text = render(result)
    assert "| ours (matched) | 0 | 285.0 | 40.0 |" in text and "| ours (layers-off) | 0 | 290.0 |" in text
    assert "| vllm | 0 | 280.0 |" in text and "160 requests, pairs `layers-off`, `matched`" in text
    # one vllm serve per command: matched and layers-off share theirs, defaults runs its own, named by its pair
    from loadtest.bench_serve import pair_servers

    vllm = {p: pair_servers(p, "/models/m", "m", "bfloat16")[1].command for p in ("matched", "layers-off", "defaults")}
    assert vllm["matched"] == vllm["layers-off"] != vllm["defaults"]
    result["cells"] = [cell("vllm", "matched", 280.0), cell("ours", "matched", 285.0),
                       cell("vllm", "defaults", 270.0), cell("ours", "defaults", 275.0)]
    text = render(result)
    assert "| vllm (matched) | 0 | 280.0 |" in text and "| vllm (defaults) | 0 | 270.0 |" in text


def test_functions_side_by_side_rank_differences_between_measured_shares_first():
    from loadtest.profile_serve import functions_side_by_side

    def cell(functions: list) -> dict:
        return {"gil": {"samples": 100, "gil_wait_share": 0.0, "functions": functions}}

    name = ["vllm", "ours (matched)", "ours (matched)"]
    cells = [cell([["forward (models/llama.py)", 0.80]]),
             cell([["forward (models/llama.py)", 0.76], ["apply (workers/sampling.py)", 0.02]]),
             cell([["forward (models/llama.py)", 0.78], ["apply (workers/sampling.py)", 0.06]])]
    lines = functions_side_by_side(name, cells)
    rows = [line for line in lines if line.startswith("| `")]
    # measured by both first, however small the difference; then the function only one list has
    assert rows == ["| `forward (models/llama.py)` | 0.800 | 0.770 |", "| `apply (workers/sampling.py)` | - | 0.040 |"]
    assert functions_side_by_side(["vllm"], cells[:1]) == []  # one server: nothing to set beside it


def test_processes_are_named_by_role():
    from loadtest.profile_serve import process_role

    assert process_role("ray::ServeContr", ["ray::ServeController.listen_for_change"]) == "ray::ServeController"
    assert process_role("ray::ServeRepli", ["ray::ServeReplica:entropic:OpenAIIngress"]) == \
        "ray::ServeReplica:entropic:OpenAIIngress"
    assert process_role("engine-abc123", ["/venv/bin/python", "-B", "-c", "from multiprocessing.spawn ..."]) == \
        "engine process"
    assert process_role("VLLM::EngineCor", ["VLLM::EngineCore_DP0"]) == "VLLM::EngineCore_DP0"
    assert process_role("python", ["/venv/bin/python", "-m", "loadtest.vllm_cli", "serve", "/models/m", "--port", "1"]) \
        == "python -m loadtest.vllm_cli serve"
    assert process_role("raylet", ["/venv/lib/ray/core/src/ray/raylet/raylet", "--node_ip_address=1"]) == "raylet"
    assert process_role("kworker/0:1", []) == "kworker/0:1"  # a kernel thread has no command line


def test_each_role_gets_its_cpu_over_the_loaded_window_only():
    """Processes are summed by role over the same window as the model thread: a process that started inside
    the window counts from zero, one sampled only before it does not count, and CPU outside it is left out."""
    hz = os.sysconf("SC_CLK_TCK")
    sampler = Sampler(pid=100)
    # CPU seconds so far at each of five samples, one second apart; the model thread is loaded from 1 s to 3 s
    model = [0.0, 0.0, 0.9, 1.8, 1.8]
    proxy = [0.0, 0.9, 1.1, 1.3, 2.2]  # 0.9 of a core outside the window, 0.2 inside
    ingress = [None, None, 0.3, 0.6, 0.9]  # started inside the window, 0.3 of a core from its start
    for i in range(5):
        processes = {100: ("VLLM::Worker", round(model[i] * hz)), 7: ("ray::ProxyActor", round(proxy[i] * hz))}
        if ingress[i] is not None:
            processes[8] = ("ray::ServeReplica:app:Ingress", round(ingress[i] * hz))
        if i == 0:
            processes[9] = ("gone", 5 * hz)  # exited before the window
        sampler.samples.append((float(i), {100: ("VLLM::Worker", round(model[i] * hz))}, (i * 2 * hz, 0, 0)))
        sampler.processes.append(processes)
    shares = sampler.summary("vllm")["process_core_shares"]
    assert shares["VLLM::Worker"] == pytest.approx(0.9, abs=0.01)
    assert shares["ray::ProxyActor"] == pytest.approx(0.2, abs=0.01)
    assert shares["ray::ServeReplica:app:Ingress"] == pytest.approx(0.3, abs=0.01)  # 0.6 s of CPU over a 2 s window
    assert "gone" not in shares


def test_the_report_sets_each_process_beside_the_other_servers_per_output_token():
    from loadtest.profile_serve import processes_side_by_side

    def cell(tok_s: float, shares: dict) -> dict:
        return {"output_throughput": tok_s, "process_core_shares": shares}

    lines = processes_side_by_side(["ours", "vllm", "ours", "vllm"], [
        cell(250.0, {"engine process": 0.9, "ray::ProxyActor": 0.1}), cell(200.0, {"VLLM::Worker": 0.8}),
        cell(250.0, {"engine process": 0.9, "ray::ProxyActor": 0.2}), cell(200.0, {"VLLM::Worker": 0.9})])
    assert "| process | ours | vllm |" in lines
    engine, proxy = "| `engine process` | 0.900 (3.60 ms) | - |", "| `ray::ProxyActor` | 0.150 (0.60 ms) | - |"
    assert "| `VLLM::Worker` | - | 0.850 (4.25 ms) |" in lines
    assert lines.index(engine) < lines.index(proxy)  # the median of 0.1 and 0.2, below the larger share
