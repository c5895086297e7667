"""A pinned engine's large steps (prefill, long-context decode) borrow the serving path's core, one engine
at a time (workers.step_threads).

Run in a child process pinned as an engine process is (its own core: the highest; the lent one: the
lowest), with real affinity, real lock files and torch's real OpenMP threads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, os, sys, threading, torch
    from pathlib import Path
    from workers.step_threads import StepThreads

    cores = sorted(os.sched_getaffinity(0))
    own, lent = (cores[-1],), (cores[0],)
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), own)  # as workers.cpu_cores pins an engine process
    lock_dir = Path(sys.argv[1])
    out = {}

    def ticks(tid):
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    def work():  # a prefill-sized matmul, long enough for the clock ticks of each thread to count
        a = torch.randn(1024, 1024)
        for _ in range(60):
            a @ a

    def engine():
        before = set(os.listdir("/proc/self/task"))
        a = StepThreads(own, lent, min_tokens=128, min_context=8192, lock_dir=lock_dir)
        b = StepThreads(own, lent, min_tokens=128, min_context=8192, lock_dir=lock_dir)  # a second engine of the node
        a.start(); b.start()
        me = threading.get_native_id()
        pool = [int(t) for t in set(os.listdir("/proc/self/task")) - before if int(t) != me]
        out["engine_thread"] = sorted(os.sched_getaffinity(0))
        out["pool"] = sorted({tuple(sorted(os.sched_getaffinity(t))) for t in pool})
        out["threads_own"] = torch.get_num_threads()
        out["small"] = a.borrow(127, 8191)
        out["large"] = a.borrow(128)
        out["threads_borrowing"] = torch.get_num_threads()
        out["other_engine"] = b.borrow(4096)
        start = {t: ticks(t) for t in pool}
        work()
        out["pool_ticks_borrowing"] = sum(ticks(t) - start[t] for t in pool)
        a.give_back()
        out["threads_after"] = torch.get_num_threads()
        out["other_engine_after"] = b.borrow(8, 8192)  # a decode step over a long context
        b.give_back()
        by_tokens_only = StepThreads(own, lent, min_tokens=128, min_context=None, lock_dir=lock_dir)  # the default
        by_tokens_only.start()
        out["decode_by_tokens_only"] = by_tokens_only.borrow(8, 10 ** 6)
        out["prefill_by_tokens_only"] = by_tokens_only.borrow(128)
        by_tokens_only.give_back()
        start = {t: ticks(t) for t in pool}
        work()
        out["pool_ticks_own"] = sum(ticks(t) - start[t] for t in pool)
        out["counts"] = [a.steps_borrowed, a.steps_refused, b.steps_borrowed, b.steps_refused]

    thread = threading.Thread(target=engine)
    thread.start(); thread.join()
    print(json.dumps(out))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="borrowing needs a core beyond the engine's own")
def test_large_steps_run_threads_on_the_lent_core_and_only_one_engine_borrows_it(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    cores = sorted(os.sched_getaffinity(0))
    own, lent = cores[-1], cores[0]
    assert out["engine_thread"] == [own]  # the stepping thread never leaves its own core
    assert out["pool"] == [[lent, own]]  # its OpenMP workers may run on the lent core
    assert out["threads_own"] == 1 and out["threads_after"] == 1
    assert out["small"] == 0 and out["large"] == 1 and out["threads_borrowing"] == 2
    assert out["other_engine"] == 0 and out["other_engine_after"] == 1  # lent to one engine at a time
    assert out["counts"] == [1, 0, 1, 1]
    # unless borrow_min_context is set, no decode step borrows, whatever its context; a prefill chunk does
    assert out["decode_by_tokens_only"] == 0 and out["prefill_by_tokens_only"] == 1
    # The lent core's thread computes while borrowed (72-131 clock ticks of 10 ms in runs here, ~0.3 s of
    # matmul per thread at the least) and not otherwise (0-1 ticks: spinning after the last region).
    assert out["pool_ticks_borrowing"] >= 20 and out["pool_ticks_own"] * 10 < out["pool_ticks_borrowing"], out


def test_a_step_counts_the_context_its_sequences_attend_over() -> None:
    """``context_tokens`` of vLLM's own ``SchedulerOutput``: a new request's prefix-cache hit and its chunk,
    and each running request's cached tokens and its one decode token."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from workers.step_threads import context_tokens

    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [NewRequestData(req_id="new", prompt_token_ids=list(range(300)), mm_features=[],
                                              sampling_params=None, pooling_params=None, block_ids=([],),
                                              num_computed_tokens=64, lora_request=None)]
    step.scheduled_cached_reqs.req_ids = ["a", "b"]
    step.scheduled_cached_reqs.num_computed_tokens = [4000, 3000]
    step.num_scheduled_tokens = {"new": 236, "a": 1, "b": 1}
    step.total_num_scheduled_tokens = 238
    assert context_tokens(step) == 64 + 4000 + 3000 + 238
    assert context_tokens(SchedulerOutput.make_empty()) == 0


# Child code both OpenMP-pool tests share: the sleeps of a pool's workers over many short parallel regions, as a
# decode step's (a worker that spins between regions sleeps ~never; a throttled one ~once a region).
REGION_SLEEPS = textwrap.dedent("""
    from pathlib import Path

    def sleeps(tid):
        status = Path(f"/proc/self/task/{tid}/status").read_text()
        return int(status.split("\\nvoluntary_ctxt_switches:")[1].split()[0])

    def sleeps_per_region(workers, regions=400):
        import torch

        x = torch.ones(1 << 17)  # above at::parallel_for's grain: a region on every op
        start = {t: sleeps(t) for t in workers}
        for _ in range(regions):
            x.add_(1.0)
        return sum(sleeps(t) - start[t] for t in workers) / regions / max(1, len(workers))
""")


POOLS_CHILD = REGION_SLEEPS + textwrap.dedent("""
    import json, os, sys, threading, torch
    from workers.step_threads import on_passing_thread, set_torch_threads

    n = len(os.sched_getaffinity(0))

    def tasks():
        return set(os.listdir("/proc/self/task"))

    def build():  # what an engine's load and warm-up leave behind: parallel regions at n threads
        torch.ones(1 << 22).sum()

    if sys.argv[1] == "passing":
        on_passing_thread(build, n)
    else:
        set_torch_threads(n)
        build()
    out = {}

    def step():  # the stepping thread: its own pool, then many short regions, as a decode step's
        before = tasks()
        set_torch_threads(n)
        torch.ones(1 << 17)  # the pool
        workers = tasks() - before
        out["workers"] = len(workers)
        out["sleeps_per_region"] = sleeps_per_region(workers)

    thread = threading.Thread(target=step)
    thread.start(); thread.join()
    print(json.dumps(out))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="an OpenMP pool needs two threads")
def test_an_engine_built_on_a_passing_thread_leaves_its_stepping_thread_the_only_openmp_pool() -> None:
    """libgomp throttles its workers' spin-wait (to ~100 iterations) while its pools hold more threads than the
    process has CPUs, so a pool left by the build makes every later region sleep and wake each worker. Runs
    here: 0.0 sleeps a region built on a passing thread, 0.995-1.0 built on the caller's (five runs each)."""
    def run(where: str) -> dict:
        result = subprocess.run([sys.executable, "-c", POOLS_CHILD, where], cwd=ROOT, capture_output=True,
                                text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    passing, caller = run("passing"), run("caller")
    workers = len(os.sched_getaffinity(0)) - 1
    assert passing["workers"] == caller["workers"] == workers
    assert passing["sleeps_per_region"] < 0.1, passing  # spinning between regions, as one pool does
    assert caller["sleeps_per_region"] > 0.5, caller  # what the passing thread avoids: a futex round trip each


PIN_CHILD = REGION_SLEEPS + textwrap.dedent("""
    import json, os, sys, threading

    cores = sorted(os.sched_getaffinity(0))
    os.environ["ENTROPIC_NODE_CORES"] = ",".join(map(str, cores))
    os.sched_setaffinity(0, {cores[0]})  # an engine process starts on the replica's cores: the serving path's
    if sys.argv[1] == "torch-first":
        import torch  # what an import of torch before the engine process pins would do
    from workers.config import ReplicaConfig
    from workers.process import _pin

    claim, steps = _pin(ReplicaConfig.model_validate({"engine": {"cpu_threads": 1}}))

    out = {"own": list(claim.cores), "borrowed": list(steps.borrowed)}

    def engine():
        before = set(os.listdir("/proc/self/task"))
        steps.start()
        workers = set(os.listdir("/proc/self/task")) - before - {str(threading.get_native_id())}
        out["taken"] = steps.borrow(4096)
        out["sleeps_per_region"] = sleeps_per_region(workers)
        steps.give_back()

    thread = threading.Thread(target=engine)
    thread.start(); thread.join()
    print(json.dumps(out))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="borrowing needs a core beyond the engine's own")
def test_the_engine_process_loads_openmp_with_the_cores_a_borrowing_step_runs_on(tmp_path: Path) -> None:
    """libgomp counts its CPUs from the affinity it loads with; an engine process that loaded it pinned to its own
    core throttled the borrowing step's worker, which then slept after every region. ``_pin`` (the engine process's
    start) loads torch with the own and the borrowed cores, and nothing the process imports before loads it
    earlier. Runs here: 0.0 sleeps a region, and 0.9975-1.005 with torch imported first (four runs each)."""
    def run(mode: str) -> dict:
        result = subprocess.run([sys.executable, "-c", PIN_CHILD, mode], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    pinned, torch_first = run("pinned"), run("torch-first")
    cores = sorted(os.sched_getaffinity(0))
    assert pinned["own"] == [cores[-1]] and pinned["borrowed"] == [cores[0]] and pinned["taken"] == 1
    assert pinned["sleeps_per_region"] < 0.1, pinned
    assert torch_first["sleeps_per_region"] > 0.5, torch_first  # the failure this guards against
