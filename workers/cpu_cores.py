"""Cores an engine process takes for itself on a CPU node, so that the serving path never preempts it.

Why: on CPU the engine's step is one thread (or ``cpu_threads`` OpenMP threads) that is busy the whole
time the replica has work. Left to float, it shares its core with whatever wakes up next to it (Serve's
proxy and replica event loops, which wake once per streamed delta); each wake-up preempts a step. vLLM's
own CPU worker pins itself and leaves a core to its API server. Pinned alone, our engine ran no faster;
with the serving path also kept off its core (``frontend_cores`` below) it did (docs/results/README.md,
the serve rows).

Each engine process claims ``count`` cores among those its process may run on (``sched_getaffinity``:
the container's cpuset, or a ``taskset`` around the server) by holding a lock file per core for as long
as it lives: the kernel drops the lock when the process exits, however it exits, so a replaced replica's
cores are free again at once. The lowest ``reserve`` cores are never claimed, so the serving path and
Ray keep a core to run on. When too few cores are free (more engines than cores), the process stays
unpinned, as before, and says so in the log: oversubscribed engines are better off floating than
stacked on one pinned core.

The rest of the serving path still floats over every core, the engines' included, unless whoever
starts Ray keeps it off them: ``deployments.server`` (``make serve``) does, with ``frontend_cores``; it
then names the node's cores in ``ENTROPIC_NODE_CORES``, which the engine processes claim from (their
own affinity, inherited from Ray, is the frontend's).
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


NODE_CORES_ENV = "ENTROPIC_NODE_CORES"
RESERVED_CORES = 1  # a node's lowest cores no engine claims: the serving path's (engines may borrow them per step)


def node_cores() -> set[int]:
    """The cores engines may claim: ``ENTROPIC_NODE_CORES`` when the server set it, else this process's."""
    named = os.environ.get(NODE_CORES_ENV)
    return {int(c) for c in named.split(",")} if named else os.sched_getaffinity(0)


def available_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota (a Kubernetes CPU limit),
    as Ray counts a node's CPUs."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    return cpus if quota == "max" else max(1, min(cpus, int(quota) // int(period)))


def threads_per_core(cores: set[int] | None = None) -> int:
    """Hardware threads per physical core among ``cores`` (default: this process's): 2 with SMT on most
    x86 machines; 1 where /sys says nothing."""
    cores = os.sched_getaffinity(0) if cores is None else cores
    physical: set[tuple[str, str]] = set()
    for core in cores:
        topology = Path(f"/sys/devices/system/cpu/cpu{core}/topology")
        try:
            physical.add(((topology / "physical_package_id").read_text().strip(),
                          (topology / "core_id").read_text().strip()))
        except OSError:
            return 1
    return max(1, round(len(cores) / len(physical))) if physical else 1


def engine_threads(node_cpus: float, engines: int, smt: int = 1, reserve: int = RESERVED_CORES) -> int:
    """OpenMP threads for each of ``engines`` engines sharing a node of ``node_cpus`` CPUs (hardware threads,
    ``smt`` of them per physical core): one thread per physical core, with ``reserve`` CPUs left to the
    serving path, which is how vLLM's CPU worker binds its threads by default; at least one."""
    return max(1, int(max(0.0, node_cpus - reserve) // max(1, engines)) // max(1, smt))


def frontend_cores(cores: set[int], engine_threads: int) -> list[int] | None:
    """The lowest cores, those engines pinned from the top leave free; None when the engines need them all."""
    ordered = sorted(cores)
    free = len(ordered) - engine_threads
    return ordered[:free] if free >= 1 else None


def default_lock_dir() -> Path:
    # Per node and per user: replicas of one node see the same directory, a pod sees its own /tmp.
    return Path(tempfile.gettempdir()) / f"entropic-cores-{os.getuid()}"


@dataclass
class CoreClaim:
    """Cores held by this process; the claim lasts while the object (its open lock files) lives."""

    cores: tuple[int, ...]
    _fds: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the only descriptor drops its flock
        self._fds.clear()


def claim_cores(count: int, *, reserve: int = RESERVED_CORES, allowed: set[int] | None = None,
                lock_dir: Path | None = None) -> CoreClaim | None:
    """Take ``count`` free cores from the top of ``allowed`` (default: ``node_cores()``), leaving
    its lowest ``reserve`` cores unclaimed; None when fewer than ``count`` are free."""
    candidates = sorted(node_cores() if allowed is None else allowed)[reserve:]
    directory = lock_dir or default_lock_dir()
    directory.mkdir(parents=True, exist_ok=True)
    claim = CoreClaim(())
    taken: list[int] = []
    for core in reversed(candidates):  # the highest first: Ray and the serving path start on the lowest
        if len(taken) == count:
            break
        fd = os.open(directory / f"core-{core}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        if not try_lock(fd):
            os.close(fd)
            continue
        claim._fds.append(fd)
        taken.append(core)
    if len(taken) < count:
        claim.release()
        return None
    claim.cores = tuple(sorted(taken))
    return claim


def try_lock(fd: int) -> bool:
    """Take the lock file's exclusive ``flock`` if it is free, without waiting."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def pin_this_process(cores: tuple[int, ...]) -> None:
    """Every thread of this process, and so every thread it starts later, runs on ``cores`` only."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def pin_engine_process(count: int, reserve: int = RESERVED_CORES) -> CoreClaim | None:
    """Claim and pin for this engine process; None (and a log line) when it floats instead."""
    try:
        claim = claim_cores(count, reserve=reserve)
        why = f"fewer than {count} cores are free beyond the {reserve} left to the serving path"
    except OSError as exc:  # no writable temporary directory: serve unpinned rather than not at all
        claim, why = None, str(exc)
    if claim is None:
        cores = tuple(sorted(node_cores()))
        pin_this_process(cores)  # the whole node, not only the frontend's cores it inherited
        logger.warning("engine process %d floats over cores %s: %s", os.getpid(), list(cores), why)
        return None
    pin_this_process(claim.cores)
    logger.info("engine process %d pinned to cores %s", os.getpid(), list(claim.cores))
    return claim
