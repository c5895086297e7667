"""Engine processes claim disjoint cores through real lock files, and a dead process's cores are free again."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workers.cpu_cores import claim_cores


def test_claims_take_the_highest_free_cores_and_never_the_reserved(tmp_path: Path) -> None:
    allowed = {0, 1, 2, 3}
    first = claim_cores(2, allowed=allowed, lock_dir=tmp_path)
    assert first is not None and first.cores == (2, 3)
    assert claim_cores(2, allowed=allowed, lock_dir=tmp_path) is None  # only core 1 is left beyond the reserve
    second = claim_cores(1, allowed=allowed, lock_dir=tmp_path)
    assert second is not None and second.cores == (1,)
    assert claim_cores(1, allowed=allowed, lock_dir=tmp_path) is None  # core 0 stays with the serving path
    first.release()
    again = claim_cores(2, allowed=allowed, lock_dir=tmp_path)
    assert again is not None and again.cores == (2, 3)


def test_a_failed_claim_holds_nothing(tmp_path: Path) -> None:
    assert claim_cores(3, allowed={0, 1, 2}, lock_dir=tmp_path) is None
    held = claim_cores(2, allowed={0, 1, 2}, lock_dir=tmp_path)
    assert held is not None and held.cores == (1, 2)


def test_a_killed_process_frees_its_cores(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from workers.cpu_cores import claim_cores
        claim = claim_cores(1, allowed={{0, 1}}, lock_dir=Path({str(tmp_path)!r}))
        print(claim.cores if claim else None, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "(1,)"
        assert claim_cores(1, allowed={0, 1}, lock_dir=tmp_path) is None  # held by the other process
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        deadline = time.monotonic() + 10
        while (claim := claim_cores(1, allowed={0, 1}, lock_dir=tmp_path)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert claim is not None and claim.cores == (1,)
    finally:
        child.kill()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell pinned from unpinned")
def test_pinning_covers_threads_started_before_and_after() -> None:
    core = max(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os, threading
        from workers.cpu_cores import pin_this_process
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        pin_this_process(({core},))
        after = threading.Thread(target=stop.wait); after.start()
        print(sorted({{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}}))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert out == f"[({core},)]"


def test_the_frontend_gets_the_cores_the_engines_leave_and_the_engines_claim_from_the_node(tmp_path: Path,
                                                                                           monkeypatch) -> None:
    from workers.cpu_cores import NODE_CORES_ENV, frontend_cores, node_cores

    assert frontend_cores({0, 1, 2, 3}, 1) == [0, 1, 2]
    assert frontend_cores({4, 5, 6, 7}, 3) == [4]  # a cpuset need not start at 0
    assert frontend_cores({0, 1}, 2) is None  # the engines need every core: nobody is confined
    monkeypatch.setenv(NODE_CORES_ENV, "0,1,2,3")
    assert node_cores() == {0, 1, 2, 3}  # not this process's own affinity, which the frontend's may narrow
    claim = claim_cores(2, lock_dir=tmp_path)
    assert claim is not None and claim.cores == (2, 3)  # the top ones: frontend_cores(..., 2) is [0, 1]
    monkeypatch.delenv(NODE_CORES_ENV)
    assert node_cores() == os.sched_getaffinity(0)
